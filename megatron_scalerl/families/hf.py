"""The HF `config.json` keys every family shares (the Llama-style decoder: RMSNorm, SwiGLU, GQA, RoPE with optional
llama3 or YaRN frequency scaling, no biases), both ways, and reading a checkpoint's config.json.

A family's own keys are its `FamilySpec.hf_fields` / `model_fields`; `families.hf_config_dict` and
`families.model_section_from_hf` put the two together. Written: the transformers-5 spelling (`rope_parameters`);
read: that one and the older one (`rope_theta` + `rope_scaling`) that released checkpoints use. A config describing
something our models do not compute (biases, other activations, other RoPE scalings, ...) is refused with the field
named, rather than converted into a different model. Model sections are plain dicts here; `recipe` validates them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_scalerl.errors import UserError

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig
    from megatron_scalerl.families.spec import FamilySpec

LLAMA3_ROPE = "llama3"  # HF's rope_type of Llama-3-style frequency scaling (recipe `model.rope_scaling`)
YARN_ROPE = "yarn"  # HF's rope_type of YaRN scaling (DeepSeek-V3; the family says whether it computes it)


def shared_hf_fields(model_cfg: ModelConfig, family: FamilySpec) -> dict[str, Any]:
    """The config.json keys every family writes (dtype float32; token ids are left to the tokenizer files)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model_cfg.rope_theta}
    if model_cfg.rope_scaling is not None:
        rope = {"rope_theta": model_cfg.rope_theta, **model_cfg.rope_scaling.hf_fields()}
    return {
        "architectures": [family.hf_architecture],
        "model_type": family.hf_model_type,
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.hidden_size,
        "num_hidden_layers": model_cfg.num_layers,
        "num_attention_heads": model_cfg.num_attention_heads,
        "num_key_value_heads": model_cfg.num_query_groups,
        "head_dim": model_cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model_cfg.max_position_embeddings,
        "rms_norm_eps": model_cfg.norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": model_cfg.tie_word_embeddings,
        "attention_bias": False,
        "torch_dtype": "float32",
    }


def shared_model_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The model-section fields every family reads from config.json (`source` names the file in errors)."""
    for field, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(field, allowed) != allowed:
            raise UserError(f"{source}: {field}={config[field]!r} is not supported ({allowed!r} only)")
    theta, scaling = _rope(config, source)
    heads = config["num_attention_heads"]
    return dict(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        max_position_embeddings=config["max_position_embeddings"],
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config["rms_norm_eps"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _rope(config: dict[str, Any], source: str) -> tuple[float, dict[str, float | int] | None]:
    """(rope_theta, the recipe's `rope_scaling` section or None)."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = dict(config.get(key) or {})
    theta = params.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise UserError(f"{source}: rope_theta is missing")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in (LLAMA3_ROPE, YARN_ROPE):
        raise UserError(f"{source}: {key} rope_type {kind!r} is not supported (default, {LLAMA3_ROPE} or {YARN_ROPE})")
    try:
        if kind == YARN_ROPE:
            return float(theta), _yarn(params, f"{source}: {key}")
        return float(theta), dict(
            rope_type=LLAMA3_ROPE,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise UserError(f"{source}: {kind} rope scaling lacks {exc.args[0]}") from None


def _yarn(params: dict[str, Any], where: str) -> dict[str, Any]:
    """The recipe's YaRN `rope_scaling` from HF's: what transformers computes, or refused. transformers applies the
    mscale ratio only when both mscale and mscale_all_dim are non-zero (else the plain 0.1 ln(factor) + 1), and
    megatron always applies it: the settings where the two differ are refused, as are keys megatron has no field
    for."""
    for unsupported in ("attention_factor", "truncate"):
        if unsupported in params and not (unsupported == "truncate" and params[unsupported] is True):
            raise UserError(f"{where} {unsupported}={params[unsupported]!r} is not supported")
    if params.get("factor") is None:
        raise UserError(f"{where}: yarn rope scaling lacks factor")
    mscale, mscale_all_dim = params.get("mscale") or 0.0, params.get("mscale_all_dim") or 0.0
    if not (mscale and mscale_all_dim) and mscale not in (0.0, 1.0) or (mscale_all_dim and not mscale):
        raise UserError(f"{where} mscale={mscale} with mscale_all_dim={mscale_all_dim}: transformers and megatron "
                        "compute this YaRN scale differently; both set (DeepSeek-V3: 1.0 and 1.0) or neither")
    return dict(
        rope_type=YARN_ROPE,
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(mscale or 1.0),
        mscale_all_dim=float(mscale_all_dim),
    )


def every_nth(flags: list[bool], source: str, field: str) -> int | None:
    """The N such that flags[i] == ((i + 1) % N == 0) for all layers i, or None when no flag is set; a pattern that
    is not every N-th layer is refused, naming config.json's `field`."""
    if not any(flags):
        return None
    interval = flags.index(True) + 1
    if flags != [(i + 1) % interval == 0 for i in range(len(flags))]:
        raise UserError(f"{source}: {field} is not a regular every-N-th-layer pattern")
    return interval


def read_config_json(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    """(path, contents) of an HF checkpoint directory's config.json: a text model's (a multimodal one is refused)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(f"{directory}: not an HF checkpoint directory (no config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON ({exc})") from None
    if "text_config" in raw:
        text = raw["text_config"]
        text_type = text.get("model_type") if isinstance(text, dict) else None
        part = f"its text part (model_type {text_type})" if text_type else "its text part"
        raise UserError(f"{path}: a multimodal config; convert {part} first")
    return path, raw
