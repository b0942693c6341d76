"""The model families (the recipe's `model.arch`), one folder each: `families/<name>/`, found by looking, so adding a
family adds no line outside its folder (docs/model_families.md).

    FAMILIES: {name: FamilySpec}, NAMES (sorted)   each folder's `FAMILY` (families/spec.py)
    hf_family(config) -> FamilySpec | None         the family of an HF config.json dict, by its model_type
    hf_config_dict(model_cfg) -> dict              the HF config.json of a recipe model section
    model_section_from_hf(config, source) -> dict  the recipe model section (unvalidated) of an HF config.json
    layer_plan(model_cfg, layer) -> LayerPlan      what global 0-based decoder layer `layer` is
    attention_chunk(model_cfg) -> int | None       the longest chunk (tokens) any layer attends within

This package is the families' pure side, below `recipe` in the layer order: no torch, no megatron-core. Each
family's torch side, `families/<name>/model` (a module or a package), belongs to the `models` layer and is loaded by
`models.family`; nothing here imports it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.families.hf import shared_hf_fields, shared_model_fields
from megatron_scalerl.families.spec import FamilySpec, LayerPlan

if TYPE_CHECKING:
    from megatron_scalerl.recipe import ModelConfig


def _discover() -> dict[str, FamilySpec]:
    """{folder name: its FAMILY} for every subpackage of this package, sorted by name."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.ispkg:
            found[info.name] = importlib.import_module(f"{__name__}.{info.name}").FAMILY
    return found


FAMILIES: dict[str, FamilySpec] = _discover()
NAMES: tuple[str, ...] = tuple(FAMILIES)


def hf_family(config: dict[str, Any]) -> FamilySpec | None:
    """The family whose text model an HF config.json describes (its `model_type`), or None."""
    return next((f for f in FAMILIES.values() if f.hf_model_type == config.get("model_type")), None)


def hf_config_dict(model_cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json of `model_cfg`: its family's text model (families/hf.py says what is written)."""
    family = FAMILIES[model_cfg.arch]
    return {**shared_hf_fields(model_cfg, family), **family.hf_fields(model_cfg)}


def model_section_from_hf(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The recipe `model` section an HF config.json describes (`source` names the file in errors), not yet
    validated (`recipe.model_config_from_hf` does)."""
    family = hf_family(config)
    if family is None:
        known = ", ".join(f.hf_model_type for f in FAMILIES.values())
        raise UserError(f"{source}: model_type {config.get('model_type')!r} is not supported ({known})")
    return {"arch": family.name, **shared_model_fields(config, source), **family.model_fields(config, source)}


def layer_plan(model_cfg: ModelConfig, layer: int) -> LayerPlan:
    """What global 0-based decoder layer `layer` of `model_cfg` is, as its family says."""
    return FAMILIES[model_cfg.arch].layer(model_cfg, layer)


def attention_chunk(model_cfg: ModelConfig) -> int | None:
    """The longest chunk (tokens) any layer's attention is confined to; None when every layer sees the whole prefix."""
    chunks = [plan.attention_chunk for i in range(model_cfg.num_layers)
              if (plan := layer_plan(model_cfg, i)).attention_chunk]
    return max(chunks, default=None)
