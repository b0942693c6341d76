"""The model families' torch side: `PARTS = ModelParts(...)` in each family's `families/<name>/model` (a module or a
package), imported the first time a model of that family is built, converted or mapped.

That module lives in the family's folder but belongs to this, the `models`, layer (tests/test_layers.py places it
here): it may import megatron-core and `models.*`; the families' pure side (`megatron_scalerl.families`, below
`recipe`) never imports it. docs/model_families.md says what goes where.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_scalerl import families

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_scalerl.models.mapping import ArchitectureMapping
    from megatron_scalerl.recipe import ModelConfig

MODEL_SIDE = "model"  # the name of the torch side's module or package in a family's folder


@dataclass(frozen=True)
class ModelParts:
    """One family's megatron-core side."""

    layer_spec: Callable[[ModelConfig, int], ModuleSpec]  # (model, global 0-based layer) -> that layer's module spec
    mapping: ArchitectureMapping  # its HF <-> Megatron weight table (models.mapping)
    rotary_interleaved: bool  # RoPE rotates (even, odd) pairs as complex numbers, not (first half, second half)
    # model section -> the family's own megatron-core TransformerConfig fields (its q/k norm, MoE routing, attention
    # settings), on top of what `models.config` sets for every family
    config_fields: Callable[[ModelConfig], dict[str, Any]] = lambda model_cfg: {}


def model_parts(model_cfg: ModelConfig) -> ModelParts:
    """The torch side of `model_cfg.arch`'s family."""
    return _parts(model_cfg.arch)


@functools.cache
def _parts(name: str) -> ModelParts:
    return importlib.import_module(f"{families.__name__}.{name}.{MODEL_SIDE}").PARTS
