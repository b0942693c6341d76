"""Which layouts a model fits, from the recipe's `ModelConfig` alone (no megatron-core import; converters use it).
What each layer is comes from its model family: `families.layer_plan`."""

from __future__ import annotations

from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig
from megatron_scalerl.recipe.rules import layout_problems


def check_model_layout(model_cfg: ModelConfig, parallel_cfg: ParallelismConfig) -> None:
    """Refuse layouts the model cannot be split into, naming the field (the recipe's own layout rules)."""
    problems = layout_problems(model_cfg, parallel_cfg)
    if problems:
        path, reason = problems[0]
        raise UserError(f"{path}: {reason}")
