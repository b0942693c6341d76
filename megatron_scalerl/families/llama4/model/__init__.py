"""Llama-4's torch side (a part of the `models` layer: models/family.py).

Each layer is the backend's base spec (`platform.layer_backend`) with what its `LayerPlan` says: a MoE or a dense
MLP, L2 QK norm or none (HF `use_qk_norm and use_rope`), and always `llama4_core_attention` (`attention.py`: chunked
attention on RoPE layers, temperature tuning on NoPE layers). Routing: sigmoid scores of the top-1 expert, applied
to the expert's input, and a shared expert of the routed size. HF keeps the MLP under `feed_forward.` (experts
stacked: `experts.gate_up_proj`), and RoPE rotates (even, odd) pairs: HF Llama-4 multiplies them as complex
numbers.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

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
    router_rule,
    shared_expert_rules,
    stacked_expert_rules,
)
from megatron_scalerl.platform.layer_backend import base_layer_spec

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig


def _layer_spec(model_cfg: ModelConfig, layer: int) -> ModuleSpec:
    plan = FAMILY.layer(model_cfg, layer)
    spec = copy.deepcopy(
        base_layer_spec(num_experts=model_cfg.num_experts if plan.moe else None, qk_norm=plan.qk_norm)
    )
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = llama4_core_attention(attention.core_attention)
    if not plan.qk_norm:
        attention.q_layernorm = IdentityOp
        attention.k_layernorm = IdentityOp
    return spec


def _config_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    """Llama-4's own TransformerConfig fields: L2 q/k norm, the attention settings `attention.py` reads, and its
    routing (sigmoid score of the one chosen expert; a shared expert)."""
    fields: dict[str, Any] = dict(
        qk_l2_norm=model_cfg.use_qk_norm,
        attention_chunk_size=model_cfg.attention_chunk_size,
        attn_temperature_tuning=model_cfg.attn_temperature_tuning,
        attn_floor_scale=model_cfg.floor_scale,
        attn_temperature_scale=model_cfg.attn_scale,
    )
    if model_cfg.is_moe:  # (the score multiplies the expert's input, LayerPlan.expert_input_weighted; the shared
        # expert: LayerPlan.shared_experts)
        fields["moe_router_score_function"] = "sigmoid"
    return fields


_FEED_FORWARD = HF_LAYER + "feed_forward."
PARTS = ModelParts(
    layer_spec=_layer_spec,
    mapping=ArchitectureMapping(
        attention=attention_rules(HF_LAYER),
        dense_mlp=dense_mlp_rules(_FEED_FORWARD),
        moe_mlp=(router_rule(_FEED_FORWARD + "router.weight"), *stacked_expert_rules(_FEED_FORWARD + "experts."),
                 *shared_expert_rules(_FEED_FORWARD + "shared_expert.")),
    ),
    rotary_interleaved=True,
    config_fields=_config_fields,
)
