"""Recipe `ModelConfig` <-> Hugging Face `config.json` (LlamaForCausalLM / Llama4ForCausalLM, text part).

`hf_config_dict(model_cfg)` writes the transformers-5 spelling (`rope_parameters`); `model_config_from_hf(d)` also
reads the older one (`rope_theta` + `rope_scaling`) that released checkpoints use. A config describing something
our models do not compute (biases, other activations, irregular MoE/NoPE layer patterns, ...) is refused with the
field named, rather than converted into a different model.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from megatron_scalerl.errors import UserError
from megatron_scalerl.models.arch import is_moe_layer, is_rope_layer
from megatron_scalerl.recipe import ModelConfig, RopeScaling

_HF_ARCH = {"llama3": ("LlamaForCausalLM", "llama"), "llama4": ("Llama4ForCausalLM", "llama4_text")}


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def hf_config_dict(model_cfg: ModelConfig) -> dict[str, Any]:
    """The HF config of `model_cfg` (dtype float32; tokens ids are left to the tokenizer files)."""
    architecture, model_type = _HF_ARCH[model_cfg.arch]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model_cfg.rope_theta}
    if model_cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": model_cfg.rope_theta, **model_cfg.rope_scaling.model_dump()}
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
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
    if model_cfg.arch == "llama3":
        config.update(intermediate_size=model_cfg.ffn_hidden_size, mlp_bias=False)
        return config
    n = model_cfg.num_layers
    config.update(
        intermediate_size=model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size,
        intermediate_size_mlp=model_cfg.ffn_hidden_size,
        num_local_experts=model_cfg.num_experts,
        num_experts_per_tok=model_cfg.moe_router_topk,
        interleave_moe_layer_step=model_cfg.moe_layer_interval,
        moe_layers=[i for i in range(n) if is_moe_layer(model_cfg, i)],
        no_rope_layers=[int(is_rope_layer(model_cfg, i)) for i in range(n)],
        attention_chunk_size=model_cfg.attention_chunk_size,
        use_qk_norm=model_cfg.use_qk_norm,
        attn_temperature_tuning=model_cfg.attn_temperature_tuning,
        floor_scale=_number(model_cfg.floor_scale),
        attn_scale=model_cfg.attn_scale,
        router_jitter_noise=0.0,
    )
    if model_cfg.nope_layer_interval is not None:
        config["no_rope_layer_interval"] = model_cfg.nope_layer_interval
    return config


def _rope(config: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise UserError(f"{source}: rope_theta is missing")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise UserError(f"{source}: rope type {kind!r} is not supported (default or llama3)")
    try:
        return float(theta), RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise UserError(f"{source}: llama3 rope scaling lacks {exc.args[0]}") from None


def _interval(flags: list[bool], source: str, field: str) -> int | None:
    """The N such that flags[i] == ((i + 1) % N == 0) for all i, or None when no flag is set."""
    if not any(flags):
        return None
    interval = flags.index(True) + 1
    if flags != [(i + 1) % interval == 0 for i in range(len(flags))]:
        raise UserError(f"{source}: {field} is not a regular every-N-th-layer pattern")
    return interval


def model_config_from_hf(config: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The recipe `model` section for an HF config (`source` names the file in errors)."""
    model_type = config.get("model_type")
    arch = {"llama": "llama3", "llama4_text": "llama4"}.get(model_type or "")
    if arch is None:
        raise UserError(f"{source}: model_type {model_type!r} is not supported (llama, llama4_text)")
    for field, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(field, allowed) != allowed:
            raise UserError(f"{source}: {field}={config[field]!r} is not supported ({allowed!r} only)")
    theta, scaling = _rope(config, source)
    heads = config["num_attention_heads"]
    n = config["num_hidden_layers"]
    fields: dict[str, Any] = dict(
        arch=arch,
        num_layers=n,
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
    if arch == "llama3":
        fields["ffn_hidden_size"] = config["intermediate_size"]
    else:
        moe_layers = set(config.get("moe_layers") or [])
        if "moe_layers" not in config:
            step = config.get("interleave_moe_layer_step", 1)
            moe_layers = set(range(step - 1, n, step))
        no_rope = config.get("no_rope_layers") or [
            int((i + 1) % config.get("no_rope_layer_interval", 4) != 0) for i in range(n)
        ]
        if config.get("router_jitter_noise", 0.0):
            raise UserError(f"{source}: router_jitter_noise must be 0")
        fields.update(
            ffn_hidden_size=config["intermediate_size_mlp"],
            num_experts=config["num_local_experts"] if moe_layers else 0,
            moe_ffn_hidden_size=config["intermediate_size"],
            moe_router_topk=config.get("num_experts_per_tok", 1),
            moe_layer_interval=_interval([i in moe_layers for i in range(n)], source, "moe_layers") or 1,
            attention_chunk_size=config.get("attention_chunk_size"),
            nope_layer_interval=_interval([not r for r in no_rope], source, "no_rope_layers"),
            use_qk_norm=bool(config.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(config.get("attn_temperature_tuning", True)),
            floor_scale=float(config.get("floor_scale", 8192)),
            attn_scale=float(config.get("attn_scale", 0.1)),
        )
    try:
        return ModelConfig(**fields)
    except ValidationError as exc:
        raise UserError(f"{source}: does not describe a supported model: {exc.errors()[0]['msg']}") from None
