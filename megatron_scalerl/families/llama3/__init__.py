"""Llama-3 (dense; HF LlamaForCausalLM, model_type llama), the family's pure side.

Every layer is the shared block (families/hf.py): RoPE (optionally llama3-scaled), GQA attention over the whole
causal prefix, a dense SwiGLU MLP of `ffn_hidden_size` (HF `intermediate_size`). vLLM serves it with its defaults.
The torch side is `model.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_scalerl.families.spec import FamilySpec, LayerPlan

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig

_EVERY_LAYER = LayerPlan(moe=False, rope=True, qk_norm=None, attention_chunk=None)


def _layer(model_cfg: ModelConfig, layer: int) -> LayerPlan:
    return _EVERY_LAYER


def _hf_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    return {"intermediate_size": model_cfg.ffn_hidden_size, "mlp_bias": False}


def _model_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    return {"ffn_hidden_size": config["intermediate_size"]}


FAMILY = FamilySpec(
    name="llama3",
    hf_architecture="LlamaForCausalLM",
    hf_model_type="llama",
    moe=False,
    layer=_layer,
    hf_fields=_hf_fields,
    model_fields=_model_fields,
)
