"""Qwen3's torch side (a part of the `models` layer: models/family.py): every layer is the backend's base spec
(`platform.layer_backend`) with per-head RMSNorms on q and k (`qk_layernorm`), HF keeps the MLP under `mlp.` and the
q/k norms as `self_attn.q_norm` / `k_norm`, and RoPE rotates (first half, second half) pairs. `qwen3_moe` reuses
`ATTENTION` and `config_fields`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_scalerl.models.family import ModelParts
from megatron_scalerl.models.mapping import (
    HF_LAYER,
    ArchitectureMapping,
    attention_rules,
    dense_mlp_rules,
    qk_norm_rules,
)
from megatron_scalerl.platform.layer_backend import base_layer_spec

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig

ATTENTION = attention_rules(HF_LAYER) + qk_norm_rules(HF_LAYER)


def config_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    """Per-head q/k RMSNorms: megatron all-reduces their gradients over TP only when the config says so."""
    return {"qk_layernorm": True}


def _layer_spec(model_cfg: ModelConfig, layer: int) -> ModuleSpec:
    return base_layer_spec(num_experts=None, qk_norm="rms")


PARTS = ModelParts(
    layer_spec=_layer_spec,
    mapping=ArchitectureMapping(attention=ATTENTION, dense_mlp=dense_mlp_rules(HF_LAYER + "mlp."), moe_mlp=()),
    rotary_interleaved=False,
    config_fields=config_fields,
)
