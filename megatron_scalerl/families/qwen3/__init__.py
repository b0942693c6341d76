"""Qwen3 (dense; HF Qwen3ForCausalLM, model_type qwen3), the family's pure side.

Every layer is the shared block (families/hf.py) with a per-head RMSNorm on q and k before RoPE (HF `q_norm` /
`k_norm`, a weight of head_dim each), RoPE on the two halves, attention over the whole causal prefix and a dense
SwiGLU MLP of `ffn_hidden_size` (HF `intermediate_size`). The small released models tie the input and output
embeddings (`tie_word_embeddings`). Sliding-window attention (`use_sliding_window`, `layer_types` other than
full_attention) is not computed and refused. The torch side is `model.py`; `qwen3_moe` shares `attention_fields`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.families.spec import FamilySpec, LayerPlan

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig

_EVERY_LAYER = LayerPlan(moe=False, rope=True, qk_norm="rms", attention_chunk=None)


def _layer(model_cfg: ModelConfig, layer: int) -> LayerPlan:
    return _EVERY_LAYER


def attention_hf_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys of Qwen3's attention (both families): full attention on every layer."""
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": model_cfg.num_layers,
            "layer_types": ["full_attention"] * model_cfg.num_layers, "attention_dropout": 0.0}


def check_attention(config: dict[str, Any], source: str) -> None:
    """Refuse (UserError naming `source` and the field) a Qwen3 attention our models do not compute."""
    if config.get("use_sliding_window"):
        raise UserError(f"{source}: use_sliding_window=true is not supported (full attention on every layer only)")
    kinds = set(config.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise UserError(f"{source}: layer_types {sorted(kinds)} is not supported (full_attention only)")


def _hf_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    return {"intermediate_size": model_cfg.ffn_hidden_size, **attention_hf_fields(model_cfg)}


def _model_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    check_attention(config, source)
    return {"ffn_hidden_size": config["intermediate_size"]}


FAMILY = FamilySpec(
    name="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    hf_model_type="qwen3",
    moe=False,
    layer=_layer,
    hf_fields=_hf_fields,
    model_fields=_model_fields,
)
