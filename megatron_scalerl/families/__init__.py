"""The model families (the recipe's `model.arch`), one folder each: `families/<name>/`, found by looking, so adding a
family adds no line outside its folder (docs/model_families.md).

    FAMILIES: {name: FamilySpec}, NAMES (sorted)   each folder's `FAMILY` (families/spec.py)
    ModelConfig                                    the recipe's `model` section: the shared fields
                                                   (model_section.py) and each family's own (`FamilySpec.fields`)
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
from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_scalerl.errors import UserError
from megatron_scalerl.families.hf import shared_hf_fields, shared_model_fields
from megatron_scalerl.families.model_section import RopeScaling, SharedModelFields
from megatron_scalerl.families.spec import FamilySpec, LayerPlan
from megatron_scalerl.section import Section

__all__ = ["FAMILIES", "NAMES", "FamilySpec", "LayerPlan", "ModelConfig", "RopeScaling", "attention_chunk",
           "hf_config_dict", "hf_family", "layer_plan", "model_section_from_hf"]


def _discover() -> dict[str, FamilySpec]:
    """{folder name: its FAMILY} for every subpackage of this package, sorted by name."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.ispkg:
            found[info.name] = importlib.import_module(f"{__name__}.{info.name}").FAMILY
    return found


FAMILIES: dict[str, FamilySpec] = _discover()
NAMES: tuple[str, ...] = tuple(FAMILIES)


def _own_fields_classes() -> tuple[type[Section], ...]:
    """Every family's own-fields class, once each. A field two families declare (norm_topk_prob: DeepSeek-V3 and
    Qwen3-MoE) must be declared alike, and none may be a shared field."""
    classes = tuple(dict.fromkeys(f.fields for f in FAMILIES.values() if f.fields is not None))
    declared: dict[str, Any] = {}
    for cls in classes:
        for name, info in cls.model_fields.items():
            if name in SharedModelFields.model_fields:
                raise ImportError(f"{cls.__qualname__}.{name}: a shared model field (families/model_section.py)")
            if name in declared and repr(declared[name]) != repr(info):
                raise ImportError(f"{cls.__qualname__}.{name}: declared otherwise by another family")
            declared[name] = info
    return classes


class ModelConfig(*reversed(_own_fields_classes()), SharedModelFields):
    """Architecture. `arch` selects the model family, `families/<arch>/`: llama3 (dense Llama-3), llama4 (Llama-4
    MoE, text part), qwen3 (dense Qwen3), qwen3_moe (Qwen3-MoE) or deepseek_v3 (DeepSeek-V3/R1, Moonlight);
    docs/model_families.md. The fields every family reads come first, then each family's own (flat: `model.<field>`)."""

    arch: Literal[NAMES] = Field(description="model family, families/<arch>/: " + ", ".join(NAMES) +
                                 " (docs/model_families.md)")

    @model_validator(mode="after")
    def _family_rules(self) -> ModelConfig:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("num_attention_heads must be a multiple of num_query_groups")
        family = FAMILIES[self.arch]
        if self.is_moe and not family.moe:
            moe = " or ".join(name for name, other in FAMILIES.items() if other.moe)
            raise ValueError(f"num_experts > 0 is only supported for arch {moe}")
        if self.is_moe and self.moe_ffn_hidden_size is None:
            raise ValueError("moe_ffn_hidden_size is required when num_experts > 0")
        if self.is_moe and self.moe_router_topk > self.num_experts:
            raise ValueError("moe_router_topk exceeds num_experts")
        for name in sorted({name for other in FAMILIES.values() for name in other.own_fields}
                           - set(family.own_fields)):
            if getattr(self, name) != type(self).model_fields[name].default:
                owners = " and ".join(f.name for f in FAMILIES.values() if name in f.own_fields)
                raise ValueError(f"{name} is a setting of arch {owners}, not of {self.arch}")
        rope_type = self.rope_scaling.rope_type if self.rope_scaling else "default"
        if rope_type not in family.rope_types:
            raise ValueError(f"rope_scaling: rope_type {rope_type} is not computed by arch {self.arch} "
                             f"({', '.join(family.rope_types)})")
        problems = family.model_problems(self) if family.model_problems else []
        if problems:
            raise ValueError("; ".join(f"{field}: {why} (arch {self.arch})" for field, why in problems))
        return self


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
