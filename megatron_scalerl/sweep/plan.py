"""What a sweep runs: its variants, and the recipe of each (variant, seed) run.

A variant is a list of dotted overrides (`key=value`, the value as YAML, exactly what `--set` takes) laid onto the
sweep's base recipe:

- `base`: no override; every sweep has it, and the report compares the others with it;
- a preset (`--variants loo_dapo_loss`) or a recipe file: its differences from its own `base:` preset, so a variant
  written against `scalerl` (the 8B recipe) changes on `--base demo` only what it names. A file that names a
  `model_preset` replaces the whole model section;
- a grid point (`--grid key=v1,v2`): one variant per value; several `--grid` give their product.

The recipe of run (variant, seed i): the base with `--model` and `--set`, the sweep's initial weights
(`trainer.init_from`) and, unless the base sets one, `data.seed` = the base's `trainer.seed` (every run draws the same
problems and validates on the same held-out prompts: those the demo's warm start held out), the variant's overrides,
then `trainer.seed` = the base's seed + i (initial sampling, the order of the training prompts), `trainer.max_steps`
= `--steps` and `trainer.max_gpu_hours` = `--budget` (GPU-hours) when given.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from megatron_scalerl.errors import RecipeError, UserError
from megatron_scalerl.fileio import load_yaml
from megatron_scalerl.recipe import (
    PRESET_DIR,
    Recipe,
    apply_overrides,
    diff,
    flatten,
    parse_override,
    resolve_dict,
    validate,
)
from megatron_scalerl.recipe.variants import respell_flat

BASE_VARIANT = "base"
NAME_CHARS = re.compile(r"[^A-Za-z0-9._+-]+")
SHAPE_SECTIONS = ("cluster.", "parallelism.")  # fields that change how many processes (GPUs) a run takes
# Fields of the base recipe that the sweep sets per run (or that name nothing a run uses): not part of `base_fields`.
PER_RUN_FIELDS = ("name", "trainer.init_from", "trainer.seed", "trainer.max_steps", "trainer.max_gpu_hours")


@dataclass(frozen=True)
class Variant:
    """One arm of the sweep: `overrides` ("key=value", value as YAML) laid onto the base; `source`: the preset or
    file it came from, "grid" or "base"."""

    name: str
    source: str
    overrides: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "overrides": list(self.overrides)}


@dataclass(frozen=True)
class BaseSpec:
    """The part every run shares: `base` (preset or file), `model` (model preset or hf:DIR), `sets` (`--set`)."""

    base: str
    model: str | None = None
    sets: tuple[str, ...] = ()
    init_from: str | None = None  # the sweep's initial weights (sweep/weights.py)
    steps: int | None = None  # optimizer steps per run (None: the recipe's trainer.max_steps)
    budget: float | None = None  # GPU-hours per run (None: no budget)

    @cached_property
    def _resolved(self) -> dict[str, Any]:
        return resolve_dict(self.base, list(self.sets), self.model)  # read once: a preset file, maybe an HF config

    def base_dict(self) -> dict[str, Any]:
        """The base recipe's mapping with `--model` and `--set` (not validated); the caller's own copy."""
        return copy.deepcopy(self._resolved)


def base_fields(base: dict[str, Any]) -> dict[str, Any]:
    """The base recipe's mapping (`BaseSpec.base_dict`) as its dotted fields, JSON values, without PER_RUN_FIELDS:
    what the manifest records to tell whether the base changed (`manifest.check_base_recipe`); a field set in the
    spelling before the variant sections (`--set trainer.min_lr=...`) as it is spelled now."""
    fields = {k: v for k, v in respell_flat(flatten(base)).items() if k not in PER_RUN_FIELDS}
    return json.loads(json.dumps(fields, default=str))


def _override(key: str, value: Any) -> str:
    """`key=<value as JSON>`: JSON is YAML, so `apply_overrides` reads the value back as it was."""
    return f"{key}={json.dumps(value)}"


def _own_base(name: str) -> tuple[str, bool]:
    """The `base:` preset a variant preset or file names, and whether it names a `model_preset`."""
    path = Path(name) if Path(name).is_file() else PRESET_DIR / f"{name}.yaml"
    data = load_yaml(path) or {}
    base = data.get("base") if isinstance(data, dict) else None
    if not isinstance(base, str):
        raise UserError(f"variant {name}: {path} names no `base:` preset; a variant is applied as its differences "
                        "from its own base, so it must name one")
    return base, "model_preset" in data


def preset_variant(name: str) -> Variant:
    """The variant of a preset name or recipe file: its differences from its own base (`name` excluded)."""
    own = resolve_dict(name)  # an unknown preset: the recipe module's error, naming it and the known ones
    base_name, names_model = _own_base(name)
    theirs = resolve_dict(base_name)
    if names_model:
        own_model = own.pop("model")
        overrides = [] if own_model == theirs.pop("model") else [_override("model", own_model)]
    else:
        overrides = []
    mine, base_flat = flatten(own), flatten(theirs)
    overrides += [_override(key, mine[key]) for key in sorted(mine) if key != "name" and mine[key] !=
                  base_flat.get(key, object())]
    return Variant(_variant_name(Path(name).stem if Path(name).is_file() else name), name, tuple(overrides))


def _variant_name(text: str) -> str:
    name = NAME_CHARS.sub("_", text).strip("_.")
    if not name or name == BASE_VARIANT:
        raise UserError(f"variant name '{text}' is reserved or empty ('{BASE_VARIANT}' is the sweep's base)")
    return name


def grid_variants(specs: list[str], base: dict[str, Any]) -> list[Variant]:
    """`--grid key=v1,v2 ...`: one variant per point of the product of the grids (values as YAML, split at commas).
    A key must be a field of the base recipe (`base`: its resolved mapping)."""
    axes, flat = [], flatten(base)
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise UserError(f"--grid {spec}: expected key=v1,v2,... (e.g. --grid trainer.lr=1e-6,5e-7)")
        if key not in flat:
            near = sorted(k for k in flat if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1])
            raise UserError(f"--grid {key}: not a field of the base recipe"
                            + (f" (did you mean {', '.join(near)}?)" if near else " (`scalerl recipe show` lists them)"))
        axes.append([(key, value.strip()) for value in values.split(",") if value.strip()])
    keys = [axis[0][0] for axis in axes]
    if len(set(keys)) != len(keys):
        raise UserError(f"--grid: a key given twice ({', '.join(sorted(k for k in keys if keys.count(k) > 1))}); "
                        "give one --grid per key with all its values")
    short = [k.rsplit(".", 1)[-1] for k in keys]
    labels = [s if short.count(s) == 1 else k for s, k in zip(short, keys, strict=True)]
    variants = []
    for point in itertools.product(*axes):
        name = "_".join(f"{label}-{value}" for label, (_, value) in zip(labels, point, strict=True))
        variants.append(Variant(_variant_name(name), "grid", tuple(f"{k}={v}" for k, v in point)))
    return variants


def variant_recipe(spec: BaseSpec, variant: Variant, seed_index: int, name: str) -> Recipe:
    """The validated recipe of run (`variant`, seed `seed_index`), named `name`. Errors name the variant."""
    data = spec.base_dict()
    seed = data.get("trainer", {}).get("seed", 0)
    common = [_override("trainer.init_from", spec.init_from)] if spec.init_from else []
    if data.get("data", {}).get("seed") is None:  # every run's data (problems, validation prompts): the base's
        common.append(f"data.seed={seed}")
    tail = [f"trainer.seed={seed + seed_index}", *([f"trainer.max_steps={spec.steps}"] if spec.steps else []),
            *([f"trainer.max_gpu_hours={spec.budget}"] if spec.budget is not None else [])]
    try:
        data = apply_overrides(data, [*common, *variant.overrides, *tail])
        data["name"] = name
        return validate(data, source=f"variant {variant.name} on base {spec.base}")
    except RecipeError as exc:
        if exc.source:
            raise
        raise RecipeError(exc.path, exc.reason, source=f"variant {variant.name} on base {spec.base}") from None


def variant_notes(spec: BaseSpec, variant: Variant, base: Recipe, recipe: Recipe) -> list[str]:
    """What the user should know about a variant beyond its own fields: a different model or cluster shape, a
    `--set` it overrides, an override that changes nothing on this base."""
    changed = {key for key, _, _ in diff(base, recipe)} - {"trainer.seed", "data.seed"}
    notes = []
    models = sorted(k for k in changed if k.startswith("model.") or k == "trainer.init_from")
    if models:
        notes.append(f"variant {variant.name} changes the model ({', '.join(models[:4])}"
                     f"{' ...' if len(models) > 4 else ''}): its runs do not start from the base's weights")
    shape = sorted(k for k in changed if k.startswith(SHAPE_SECTIONS))
    if shape:
        notes.append(f"variant {variant.name} changes the cluster shape or layout ({', '.join(shape[:4])}): "
                     f"{base.cluster.total_gpus} -> {recipe.cluster.total_gpus} processes (GPUs) per run")
    mine = {".".join(parse_override(o)[0]) for o in variant.overrides}
    overridden = sorted(mine & {".".join(parse_override(s)[0]) for s in spec.sets})
    if overridden:
        notes.append(f"variant {variant.name} overrides --set {', '.join(overridden)}")
    if variant.overrides and not changed:
        notes.append(f"variant {variant.name} changes nothing on base {spec.base}: it is a second base")
    return notes
