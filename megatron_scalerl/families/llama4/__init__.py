"""Llama-4 (the text part; HF Llama4ForCausalLM, model_type llama4_text), the family's pure side.

Layers, global 0-based index i (HF conventions):
  MoE    when (i + 1) % moe_layer_interval == 0 (HF `interleave_moe_layer_step`; `moe_layers`) and num_experts > 0:
         sigmoid top-1 routing applied to the expert input (`model/`: the megatron-core router settings), plus a
         shared expert of the routed experts' size; otherwise the dense MLP
         (`ffn_hidden_size`, HF `intermediate_size_mlp`);
  NoPE   when (i + 1) % nope_layer_interval == 0 (HF `no_rope_layers[i] == 0`): no RoPE, attention over the whole
         prefix, queries temperature-tuned (`attn_temperature_tuning`); every other layer has RoPE, attention within
         chunks of `attention_chunk_size` tokens and, with `use_qk_norm`, an L2 norm on q and k.
Serving: vLLM needs the attention chunk to be a multiple of its KV block (`_kv_block_size`). The torch side (layer
specs, the chunked attention, the weight table) is `model/`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pydantic import Field

from megatron_scalerl.errors import UserError
from megatron_scalerl.families.hf import every_nth
from megatron_scalerl.families.spec import FamilySpec, LayerPlan
from megatron_scalerl.section import Pos, PosFloat, Section

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig


class Llama4Fields(Section):
    """The model-section fields only Llama-4 reads (`model.attention_chunk_size`, ...; another family's model
    refuses them away from these defaults)."""

    attention_chunk_size: Pos | None = Field(
        None, description="Llama-4: chunked local attention on RoPE layers, chunk length (tokens); null: none")
    nope_layer_interval: Pos | None = Field(
        None, description="Llama-4: every N-th layer has no RoPE and attends globally (layers); null: none")
    use_qk_norm: bool = Field(False, description="Llama-4: L2 norm on the queries and keys of RoPE layers")
    attn_temperature_tuning: bool = Field(
        False, description="Llama-4: scale NoPE layers' queries by log(floor((pos + 1) / floor_scale) + 1)")
    floor_scale: PosFloat = Field(
        8192.0, description="Llama-4 temperature tuning: positions per step of the query scale's log (tokens)")
    attn_scale: PosFloat = Field(0.1, description="Llama-4 temperature tuning: the query scale's slope (dimensionless)")


def _layer(model_cfg: ModelConfig, layer: int) -> LayerPlan:
    interval = model_cfg.nope_layer_interval
    rope = interval is None or (layer + 1) % interval != 0
    return LayerPlan(
        moe=model_cfg.is_moe and (layer + 1) % model_cfg.moe_layer_interval == 0,
        rope=rope,
        qk_norm="l2" if model_cfg.use_qk_norm and rope else None,
        attention_chunk=model_cfg.attention_chunk_size if rope else None,
        shared_experts=1,
        expert_input_weighted=True,
    )


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _hf_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    layers = [_layer(model_cfg, i) for i in range(model_cfg.num_layers)]
    fields: dict[str, Any] = dict(
        intermediate_size=model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size,
        intermediate_size_mlp=model_cfg.ffn_hidden_size,
        num_local_experts=model_cfg.num_experts,
        num_experts_per_tok=model_cfg.moe_router_topk,
        interleave_moe_layer_step=model_cfg.moe_layer_interval,
        moe_layers=[i for i, plan in enumerate(layers) if plan.moe],
        no_rope_layers=[int(plan.rope) for plan in layers],
        attention_chunk_size=model_cfg.attention_chunk_size,
        use_qk_norm=model_cfg.use_qk_norm,
        attn_temperature_tuning=model_cfg.attn_temperature_tuning,
        floor_scale=_number(model_cfg.floor_scale),
        attn_scale=model_cfg.attn_scale,
        router_jitter_noise=0.0,
    )
    if model_cfg.nope_layer_interval is not None:
        fields["no_rope_layer_interval"] = model_cfg.nope_layer_interval
    return fields


def _model_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    n = config["num_hidden_layers"]
    moe_layers = set(config.get("moe_layers") or [])
    if "moe_layers" not in config:
        step = config.get("interleave_moe_layer_step", 1)
        moe_layers = set(range(step - 1, n, step))
    no_rope = config.get("no_rope_layers") or [
        int((i + 1) % config.get("no_rope_layer_interval", 4) != 0) for i in range(n)
    ]
    if config.get("router_jitter_noise", 0.0):
        raise UserError(f"{source}: router_jitter_noise must be 0")
    return dict(
        ffn_hidden_size=config["intermediate_size_mlp"],
        num_experts=config["num_local_experts"] if moe_layers else 0,
        moe_ffn_hidden_size=config["intermediate_size"],
        moe_router_topk=config.get("num_experts_per_tok", 1),
        moe_layer_interval=every_nth([i in moe_layers for i in range(n)], source, "moe_layers") or 1,
        attention_chunk_size=config.get("attention_chunk_size"),
        nope_layer_interval=every_nth([not r for r in no_rope], source, "no_rope_layers"),
        use_qk_norm=bool(config.get("use_qk_norm", True)),
        attn_temperature_tuning=bool(config.get("attn_temperature_tuning", True)),
        floor_scale=float(config.get("floor_scale", 8192)),
        attn_scale=float(config.get("attn_scale", 0.1)),
    )


def _kv_block_size(config: dict[str, Any], default: int) -> int | None:
    """vLLM needs the attention chunk to be a multiple of its KV block: the largest divisor of the `default` block
    (tokens) that divides the chunk, or None when `default` does (the tiny presets' 32-token chunk is shorter than
    vLLM's 128-token block on CPUs)."""
    chunk = config.get("attention_chunk_size")
    if not chunk:
        return None
    block = math.gcd(int(chunk), default)
    return None if block == default else block


def _model_problems(model_cfg: ModelConfig) -> list[tuple[str, str]]:
    if model_cfg.is_moe and model_cfg.moe_router_topk != 1:
        return [("moe_router_topk", "Llama-4 routing applies the score to the expert input: only 1")]
    return []


def _generation_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's `attn_temperature_tuning`: vLLM otherwise decides it from `max_model_len` (on only above 32k
    tokens) and would compute another function than the trainer."""
    tuning = config.get("attn_temperature_tuning")
    return {} if tuning is None else {"attn_temperature_tuning": tuning}


FAMILY = FamilySpec(
    name="llama4",
    hf_architecture="Llama4ForCausalLM",
    hf_model_type="llama4_text",
    moe=True,
    layer=_layer,
    hf_fields=_hf_fields,
    model_fields=_model_fields,
    model_problems=_model_problems,
    kv_block_size=_kv_block_size,
    generation_overrides=_generation_overrides,
    fields=Llama4Fields,
)
