"""Qwen3-MoE (HF Qwen3MoeForCausalLM, model_type qwen3_moe), the family's pure side.

Attention as Qwen3's (`families.qwen3`: per-head RMSNorm on q and k, RoPE on the two halves, full attention). The
MLP of layer i (global, 0-based) is routed experts when (i + 1) % moe_layer_interval == 0 (HF `decoder_sparse_step`)
and num_experts > 0, else a dense SwiGLU MLP of `ffn_hidden_size` (HF `intermediate_size`); HF's `mlp_only_layers`
is read into that rule, and a pattern it cannot state is refused. Routing: softmax over all experts' logits, the
top `moe_router_topk` chosen, their weights renormalised over the chosen ones when `norm_topk_prob` (the released
models) and not otherwise, multiplied into the experts' outputs; no shared expert. HF's `router_aux_loss_coef` is
not read: the auxiliary loss is the recipe's `model.moe_aux_loss_coeff` (off by default in RL) and is written back
as that key. The torch side is `model.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from megatron_scalerl.errors import UserError
from megatron_scalerl.families.hf import every_nth
from megatron_scalerl.families.qwen3 import attention_hf_fields, check_attention
from megatron_scalerl.families.spec import FamilySpec, LayerPlan
from megatron_scalerl.section import Section

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig


class Qwen3MoeFields(Section):
    """The model-section field Qwen3-MoE reads beyond the shared ones (DeepSeek-V3 reads it too)."""

    norm_topk_prob: bool = Field(
        True, description="softmax routing (Qwen3-MoE): the top-k weights renormalised to sum to 1 (HF's key)")


def _layer(model_cfg: ModelConfig, layer: int) -> LayerPlan:
    return LayerPlan(moe=model_cfg.is_moe and (layer + 1) % model_cfg.moe_layer_interval == 0, rope=True,
                     qk_norm="rms", attention_chunk=None)


def _hf_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    return dict(
        intermediate_size=model_cfg.ffn_hidden_size,
        moe_intermediate_size=model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size,
        num_experts=model_cfg.num_experts,
        num_experts_per_tok=model_cfg.moe_router_topk,
        decoder_sparse_step=model_cfg.moe_layer_interval,
        mlp_only_layers=[],
        norm_topk_prob=model_cfg.norm_topk_prob,
        router_aux_loss_coef=model_cfg.moe_aux_loss_coeff,
        output_router_logits=False,
        **attention_hf_fields(model_cfg),
    )


def _model_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    check_attention(config, source)
    n = config["num_hidden_layers"]
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts is None:
        raise UserError(f"{source}: num_experts is missing")
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise UserError(f"{source}: decoder_sparse_step={step!r} is not a positive integer")
    dense_only = set(config.get("mlp_only_layers") or [])
    moe = [experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n)]
    field = "mlp_only_layers" if dense_only else "decoder_sparse_step"
    interval = every_nth(moe, source, f"{field} (with decoder_sparse_step {step})")
    return dict(
        ffn_hidden_size=config["intermediate_size"],
        num_experts=experts if interval else 0,
        moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_router_topk=config.get("num_experts_per_tok", 1),
        moe_layer_interval=interval or 1,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
    )


FAMILY = FamilySpec(
    name="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    hf_model_type="qwen3_moe",
    moe=True,
    layer=_layer,
    hf_fields=_hf_fields,
    model_fields=_model_fields,
    fields=Qwen3MoeFields,
)
