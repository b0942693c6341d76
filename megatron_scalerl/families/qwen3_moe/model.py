"""Qwen3-MoE's torch side (a part of the `models` layer: models/family.py): Qwen3's attention (`families.qwen3.model`)
and, on MoE layers, megatron-core's router with softmax scores (top-k of the logits then a softmax over them, which
is HF's renormalised top-k, when `norm_topk_prob`; a softmax over all experts then the top-k otherwise) weighting
the experts' outputs, no shared expert. HF names the router `mlp.gate` and keeps one tensor per expert
(`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`), fused per expert as megatron-core's linear_fc1 [gate; up]."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_scalerl.families.qwen3.model import ATTENTION
from megatron_scalerl.families.qwen3.model import config_fields as qwen3_config_fields
from megatron_scalerl.families.qwen3_moe import FAMILY
from megatron_scalerl.models.family import ModelParts
from megatron_scalerl.models.mapping import (
    HF_LAYER,
    ArchitectureMapping,
    dense_mlp_rules,
    per_expert_rules,
    router_rule,
)
from megatron_scalerl.platform.layer_backend import base_layer_spec

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig


def _layer_spec(model_cfg: ModelConfig, layer: int) -> ModuleSpec:
    plan = FAMILY.layer(model_cfg, layer)
    return base_layer_spec(num_experts=model_cfg.num_experts if plan.moe else None, qk_norm=plan.qk_norm)


def _config_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    fields = qwen3_config_fields(model_cfg)
    if model_cfg.is_moe:
        fields.update(moe_router_score_function="softmax", moe_router_pre_softmax=not model_cfg.norm_topk_prob)
    return fields


_MLP = HF_LAYER + "mlp."
PARTS = ModelParts(
    layer_spec=_layer_spec,
    mapping=ArchitectureMapping(
        attention=ATTENTION,
        dense_mlp=dense_mlp_rules(_MLP),
        moe_mlp=(router_rule(_MLP + "gate.weight"), *per_expert_rules(_MLP + "experts.{expert}.")),
    ),
    rotary_interleaved=False,
    config_fields=_config_fields,
)
