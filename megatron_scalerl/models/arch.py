"""Which layers are what, and which layouts fit, from the recipe's `ModelConfig` alone (no megatron-core import; converters use it).

Layer indices are global and 0-based. Hugging Face Llama-4 conventions:
  MoE layers:  `moe_layers = range(interleave_moe_layer_step - 1, num_layers, step)`
  NoPE layers: every `no_rope_layer_interval`-th layer (1-based) has no RoPE and attends globally.
"""

from __future__ import annotations

from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig
from megatron_scalerl.recipe_rules import layout_problems


def is_moe_layer(model_cfg: ModelConfig, layer: int) -> bool:
    return model_cfg.is_moe and (layer + 1) % model_cfg.moe_layer_interval == 0


def is_rope_layer(model_cfg: ModelConfig, layer: int) -> bool:
    interval = model_cfg.nope_layer_interval
    return interval is None or (layer + 1) % interval != 0


def check_model_layout(model_cfg: ModelConfig, parallel_cfg: ParallelismConfig) -> None:
    """Refuse layouts the model cannot be split into, naming the field (the recipe's own layout rules)."""
    problems = layout_problems(model_cfg, parallel_cfg)
    if problems:
        path, reason = problems[0]
        raise UserError(f"{path}: {reason}")
