"""Llama-3's torch side (a part of the `models` layer: models/family.py): every layer is the backend's base spec
(`platform.layer_backend`), HF keeps the MLP under `mlp.`, and RoPE rotates (first half, second half) pairs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_scalerl.models.family import ModelParts
from megatron_scalerl.models.mapping import HF_LAYER, ArchitectureMapping, attention_rules, dense_mlp_rules
from megatron_scalerl.platform.layer_backend import base_layer_spec

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig


def _layer_spec(model_cfg: ModelConfig, layer: int) -> ModuleSpec:
    return base_layer_spec(num_experts=None, qk_norm=None)


PARTS = ModelParts(
    layer_spec=_layer_spec,
    mapping=ArchitectureMapping(
        attention=attention_rules(HF_LAYER), dense_mlp=dense_mlp_rules(HF_LAYER + "mlp."), moe_mlp=()
    ),
    rotary_interleaved=False,
)
