"""Llama-4's torch side (a part of the `models` layer: models/family.py).

Each layer is the backend's base spec (`platform.layer_backend`) with what its `LayerPlan` says: a MoE or a dense
MLP, L2 QK norm or none (HF `use_qk_norm and use_rope`), and always `llama4_core_attention` (`attention.py`: chunked
attention on RoPE layers, temperature tuning on NoPE layers). HF keeps the MLP under `feed_forward.`, and RoPE
rotates (even, odd) pairs: HF Llama-4 multiplies them as complex numbers.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_scalerl.families.llama4 import FAMILY
from megatron_scalerl.families.llama4.model.attention import llama4_core_attention
from megatron_scalerl.models.family import ModelParts
from megatron_scalerl.models.mapping import (
    HF_LAYER,
    ArchitectureMapping,
    attention_rules,
    dense_mlp_rules,
    moe_mlp_rules,
)
from megatron_scalerl.platform.layer_backend import base_layer_spec

if TYPE_CHECKING:
    from megatron_scalerl.recipe import ModelConfig


def _layer_spec(model_cfg: ModelConfig, layer: int) -> ModuleSpec:
    plan = FAMILY.layer(model_cfg, layer)
    spec = copy.deepcopy(
        base_layer_spec(num_experts=model_cfg.num_experts if plan.moe else None, qk_l2_norm=plan.qk_norm)
    )
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = llama4_core_attention(attention.core_attention)
    if not plan.qk_norm:
        attention.q_layernorm = IdentityOp
        attention.k_layernorm = IdentityOp
    return spec


PARTS = ModelParts(
    layer_spec=_layer_spec,
    mapping=ArchitectureMapping(
        attention=attention_rules(HF_LAYER),
        dense_mlp=dense_mlp_rules(HF_LAYER + "feed_forward."),
        moe_mlp=moe_mlp_rules(HF_LAYER + "feed_forward."),
    ),
    rotary_interleaved=True,
)
