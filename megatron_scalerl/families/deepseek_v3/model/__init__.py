"""DeepSeek-V3's torch side (a part of the `models` layer: models/family.py).

Each layer is the backend's multi-latent-attention spec (`platform.layer_backend.base_layer_spec`) with a dense or a
MoE MLP as its `LayerPlan` says; on megatron's local layers the core attention is `attention.py`'s (it takes the
q/k and v head sizes the local one does not). megatron-core's `MLATransformerConfig` fields carry the latent sizes
and the RoPE (plain or YaRN, de-interleaved by MLA itself: `rotary_interleaved` stays off). Routing: sigmoid
scores, the checkpoint's score-correction bias (`router.expert_bias`, an FP32 buffer that training never moves:
`models.config` from `LayerPlan.router_expert_bias`), group-limited top-k, weights renormalised and scaled by `routed_scaling_factor`, in FP32
(`moe_router_dtype`) as HF computes them; shared experts as one SwiGLU of n_shared_experts x moe_ffn_hidden_size.
HF names the router `mlp.gate` and keeps one tensor per expert (`mlp.experts.{e}.gate_proj` ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_scalerl.families.deepseek_v3 import FAMILY
from megatron_scalerl.families.deepseek_v3.model.attention import LatentCoreAttention
from megatron_scalerl.families.hf import YARN_ROPE
from megatron_scalerl.models.family import ModelParts
from megatron_scalerl.models.mapping import (
    HF_LAYER,
    ArchitectureMapping,
    TensorRule,
    dense_mlp_rules,
    latent_attention_rules,
    per_expert_rules,
    router_bias_rule,
    router_rule,
    shared_expert_rules,
)
from megatron_scalerl.platform.layer_backend import base_layer_spec

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig


def _layer_spec(model_cfg: ModelConfig, layer: int) -> ModuleSpec:
    plan = FAMILY.layer(model_cfg, layer)
    spec = base_layer_spec(num_experts=model_cfg.num_experts if plan.moe else None, qk_norm=None,
                           latent_attention=plan.latent_attention)
    attention = spec.submodules.self_attention.submodules
    if attention.core_attention is DotProductAttention:  # megatron's local layers (TE's attention takes both sizes)
        attention.core_attention = LatentCoreAttention  # (base_layer_spec builds a fresh spec each call)
    return spec


def _config_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    """megatron-core's MLA fields (`MLATransformerConfig`) and DeepSeek-V3's routing."""
    rope = model_cfg.rope_scaling
    yarn = rope is not None and rope.rope_type == YARN_ROPE
    fields: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=model_cfg.q_lora_rank,
        kv_lora_rank=model_cfg.kv_lora_rank,
        qk_head_dim=model_cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=model_cfg.qk_rope_head_dim,
        v_head_dim=model_cfg.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        # without YaRN megatron's softmax scale still reads these: 1 and 0 make its mscale 1
        rotary_scaling_factor=rope.factor if yarn else 1.0,
        mscale=rope.mscale if yarn else 1.0,
        mscale_all_dim=rope.mscale_all_dim if yarn else 0.0,
        **(dict(original_max_position_embeddings=rope.original_max_position_embeddings, beta_fast=rope.beta_fast,
                beta_slow=rope.beta_slow) if yarn else {}),
    )
    if model_cfg.is_moe:
        grouped = model_cfg.n_group > 1
        fields.update(
            moe_router_score_function="sigmoid",  # (the bias and the shared experts: their LayerPlan fields)
            moe_router_num_groups=model_cfg.n_group if grouped else None,
            moe_router_group_topk=model_cfg.topk_group if grouped else None,
            moe_router_topk_scaling_factor=model_cfg.routed_scaling_factor,
            moe_router_dtype="fp32",
        )
    return fields


def _attention_rules(model_cfg: ModelConfig) -> tuple[TensorRule, ...]:
    return latent_attention_rules(HF_LAYER, q_lora=model_cfg.q_lora_rank is not None)


_MLP = HF_LAYER + "mlp."
PARTS = ModelParts(
    layer_spec=_layer_spec,
    mapping=ArchitectureMapping(
        attention=_attention_rules,
        dense_mlp=dense_mlp_rules(_MLP),
        moe_mlp=(router_rule(_MLP + "gate.weight"), router_bias_rule(_MLP + "gate.e_score_correction_bias"),
                 *per_expert_rules(_MLP + "experts.{expert}."), *shared_expert_rules(_MLP + "shared_experts.")),
    ),
    rotary_interleaved=False,
    config_fields=_config_fields,
)
