"""Loading and composition: one validated `Recipe` from YAML presets and dotted overrides.

Resolution order (later wins):
  1. the `base:` preset named by the file (recursively resolved; a file without `base:` must be complete),
  2. the `model_preset:` it names (replaces the whole `model` section, merges its other sections); `hf:DIR` takes
     the model section from an HF checkpoint's config.json and starts the trainer from its weights
     (`trainer.init_from: DIR`), keeping the base's layout,
  3. the file's own keys,
  4. `--set a.b.c=value` overrides from the command line.

Validation (`validate`) checks the types and ranges of schema.py, then the cross-field rules of rules.py, and
raises RecipeError naming the first bad field (an unknown key with the nearest known ones, explain.py). flatten /
changed_fields / diff compare recipes field by field; preset_catalogue gathers the presets `scalerl recipe explain`
compares a key across. A run's own recipe (RUN/recipe.yaml) is read by `load_run_recipe` alone;
`require_init_from_matches` refuses an HF `trainer.init_from` whose config.json describes another model.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from megatron_scalerl import families
from megatron_scalerl.errors import RecipeError, UserError
from megatron_scalerl.families import ModelConfig
from megatron_scalerl.families.hf import read_config_json
from megatron_scalerl.fileio import load_yaml, parse_yaml
from megatron_scalerl.recipe.explain import Presets, unknown_key_hint, variant_tag_key, variant_tags
from megatron_scalerl.recipe.rules import cross_field_problems
from megatron_scalerl.recipe.schema import Recipe
from megatron_scalerl.recipe.variants import switch_variant

PRESET_DIR = Path(__file__).parent.parent / "recipes"  # megatron_scalerl/recipes/
MODEL_PRESET_DIR = PRESET_DIR / "models"
DEFAULT_BASE = "scalerl"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def model_preset_names() -> list[str]:
    return sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.yaml"))


def _preset_path(name: str, folder: Path, what: str, known: list[str]) -> Path:
    path = folder / f"{name}.yaml"
    if not path.is_file():
        raise RecipeError("", f"unknown {what} '{name}' (known: {', '.join(known)})")
    return path


def _read_mapping(path: Path) -> dict[str, Any]:
    data = load_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError("", f"top level must be a mapping, got {type(data).__name__}", source=str(path))
    return data


def deep_merge(base: dict[str, Any], top: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Mappings merge key by key; anything else in `top` replaces what `base` has (a bare name over a variant
    section changes its alternative, keeping its fields: `variants.switch_variant`). `prefix`: the dotted key of
    `base` in the recipe."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value, path)
        else:
            out[key] = switch_variant(out.get(key), copy.deepcopy(value), variant_tag_key(path))
    return out


HF_MODEL_PREFIX = "hf:"


def model_config_from_hf(config: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The model section an HF config.json describes, through its family's translation (`source` names the file in
    errors)."""
    try:
        return ModelConfig(**families.model_section_from_hf(config, source))
    except ValidationError as exc:
        raise UserError(f"{source}: does not describe a supported model: {exc.errors()[0]['msg']}") from None


def read_hf_config(directory: str | Path) -> tuple[dict[str, Any], ModelConfig]:
    """(raw config.json, our ModelConfig) of an HF checkpoint directory."""
    path, raw = read_config_json(directory)
    return raw, model_config_from_hf(raw, str(path))


def _hf_model_preset(directory: str) -> dict[str, Any]:
    """`hf:DIR` as a model preset: the model section of DIR/config.json, and the trainer starting from DIR."""
    try:
        _, model_cfg = read_hf_config(directory)
    except UserError as exc:
        raise RecipeError("model_preset", str(exc)) from None
    return {"model": model_cfg.model_dump(mode="json"), "trainer": {"init_from": str(Path(directory).resolve())}}


def _apply_model_preset(data: dict[str, Any], name: str) -> dict[str, Any]:
    """`name`: a model preset, or `hf:DIR` (an HF checkpoint directory)."""
    if name.startswith(HF_MODEL_PREFIX):
        preset = _hf_model_preset(name[len(HF_MODEL_PREFIX):])
    else:
        preset = _read_mapping(_preset_path(name, MODEL_PRESET_DIR, "model preset", model_preset_names()))
    merged = deep_merge(data, {k: v for k, v in preset.items() if k != "model"})
    merged["model"] = copy.deepcopy(preset.get("model", {}))
    return merged


def _resolve_file(path: Path, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    key = str(path.resolve())
    if key in seen:
        raise RecipeError("base", f"preset cycle: {' -> '.join(seen + (key,))}", source=str(path))
    data = _read_mapping(path)
    base_name = data.pop("base", None)
    model_preset = data.pop("model_preset", None)
    merged: dict[str, Any] = {}
    if base_name is not None:
        if not isinstance(base_name, str):
            raise RecipeError("base", "must be a preset name", source=str(path))
        base_path = _preset_path(base_name, PRESET_DIR, "base preset", preset_names())
        merged = _resolve_file(base_path, seen + (key,))
    if model_preset is not None:
        if not isinstance(model_preset, str):
            raise RecipeError("model_preset", "must be a model preset name", source=str(path))
        merged = _apply_model_preset(merged, model_preset)
    merged = deep_merge(merged, data)
    merged["name"] = data.get("name", path.stem)
    return merged


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=1e-6` -> (['trainer', 'lr'], 1e-06). The value is parsed as YAML (numbers, bools, lists)."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise RecipeError("", f"bad override '{text}': expected dotted.key=value")
    return parts, parse_yaml(raw, f"--set {text}") if raw.strip() else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            tag_key = variant_tag_key(".".join(parts[: i + 1]))
            if isinstance(child, str) and tag_key:  # `loss: cispo` (a bare name), then `--set algorithm.loss.eps_max`
                child = node[part] = {tag_key: child}
            if not isinstance(child, dict):
                raise RecipeError(".".join(parts[: i + 1]), f"is not a section (override '{text}')")
            node = child
        node[parts[-1]] = switch_variant(node.get(parts[-1]), value, variant_tag_key(".".join(parts)))
    return out


def resolve_dict(name_or_path: str | Path, overrides: list[str] = (), model_preset: str | None = None) -> dict:
    """The merged, not yet validated recipe mapping."""
    path = Path(name_or_path)
    if not path.is_file():
        if str(name_or_path) in model_preset_names() and str(name_or_path) not in preset_names():
            model_preset, path = str(name_or_path), PRESET_DIR / f"{DEFAULT_BASE}.yaml"
        elif path.suffix in (".yaml", ".yml") or "/" in str(name_or_path):
            raise RecipeError("", f"recipe file not found: {name_or_path}")
        else:
            path = _preset_path(str(name_or_path), PRESET_DIR, "preset", preset_names())
    data = _resolve_file(path)
    if model_preset:
        data = _apply_model_preset(data, model_preset)
        data["name"] = f"{data['name']}+{model_preset}"
    return apply_overrides(data, list(overrides))


def _format_loc(loc: tuple) -> str:
    """pydantic's error location as a recipe key; the alternative's tag it puts after a variant section is left out
    (`algorithm.loss.cispo.eps_max` -> `algorithm.loss.eps_max`)."""
    out = ""
    for part in loc:
        if isinstance(part, str) and part in variant_tags(out):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate(data: dict[str, Any], source: str | None = None) -> Recipe:
    """Validate a recipe mapping; raise RecipeError naming the first bad field (and listing the others)."""
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            path = _format_loc(loc)
            if err["type"] == "extra_forbidden":
                reason = "unknown key" + unknown_key_hint(tuple(err["loc"]), err.get("input"))
            elif err["type"] == "missing":
                reason = "missing required key"
            else:
                reason = f"{err['msg']} (got {err.get('input')!r})"
            problems.append((path, reason))
        first_path, first_reason = problems[0]
        more = f" (+{len(problems) - 1} more: {', '.join(p for p, _ in problems[1:4])})" if len(problems) > 1 else ""
        raise RecipeError(first_path, first_reason + more, source=source) from None
    problems = cross_field_problems(recipe)
    if problems:
        path, reason = problems[0]
        more = f" (+{len(problems) - 1} more: {', '.join(p for p, _ in problems[1:4])})" if len(problems) > 1 else ""
        raise RecipeError(path, reason + more, source=source)
    if recipe.parallelism.dp is None:
        dp = recipe.parallelism.dp_size(recipe.cluster.trainer_gpus)
        recipe = recipe.model_copy(update={"parallelism": recipe.parallelism.model_copy(update={"dp": dp})})
    return recipe


def load_recipe(name_or_path: str | Path, overrides: list[str] = (), model_preset: str | None = None) -> Recipe:
    """Resolve a preset name or recipe file, apply the model preset and overrides, validate."""
    data = resolve_dict(name_or_path, overrides, model_preset)
    return validate(data, source=str(name_or_path))


def load_run_recipe(run_dir: str | Path, file_name: str, overrides: list[str] = (), *,
                    missing_ok: bool = False) -> Recipe | None:
    """The recipe of the run in `run_dir`: its file `file_name` (`run.directory.RECIPE_FILE`, written by the
    launcher), with `overrides` applied (a trainer's `--set`), validated. A missing file is a UserError naming the
    run directory and the file (None with `missing_ok`); a damaged one a RecipeError naming the file and the field."""
    path = Path(run_dir) / file_name
    if not path.is_file():
        if missing_ok:
            return None
        raise UserError(f"{run_dir}: no {file_name}, not a run directory (a run's launcher writes it)")
    return load_recipe(path, overrides)


def require_init_from_matches(recipe: Recipe) -> None:
    """Refuse an HF checkpoint `trainer.init_from` (a directory with a config.json) of another model than
    `recipe.model`: its config.json, translated by its family (`model_config_from_hf`), must agree with the model
    section on every field the translation gives; else a UserError naming the file and each differing field (the
    recipe's value, config.json's). The weights would not fit the model the trainer builds (a shape), or would
    compute another function than the checkpoint's (a RoPE base, a norm epsilon). Run by the launcher before any
    role starts and by every trainer rank before it builds its model. A Megatron checkpoint (no config.json at its
    top) is checked against the model config it stores (`checkpoint.sharded.require_model_config`)."""
    source = recipe.trainer.init_from
    if not source or not (Path(source) / "config.json").is_file():
        return
    path, raw = read_config_json(source)
    theirs = model_config_from_hf(raw, str(path))
    ours, given = recipe.model.model_dump(mode="json"), theirs.model_dump(mode="json")
    differing = sorted(k for k in theirs.model_fields_set if ours[k] != given[k])
    if differing:
        fields = "; ".join(f"model.{k}: {ours[k]!r} in the recipe, {given[k]!r} in config.json" for k in differing)
        raise UserError(f"trainer.init_from: {path} describes another model than the recipe's model section "
                        f"({len(differing)} field(s) differ): {fields}; start from a checkpoint of the recipe's "
                        f"model, or take the model section from this one (--model hf:{path.parent})")


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


_ABSENT = object()


def changed_fields(a: Any, b: Any) -> list[str]:
    """Sorted dotted names of the fields whose values differ between two (nested) dicts, a field present in one only
    included (`{'m': {'x': 1}}` vs `{'m': {'x': 2, 'y': 0}}` -> ['m.x', 'm.y'])."""
    fa, fb = flatten(a), flatten(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, _ABSENT) != fb.get(k, _ABSENT))


def diff(a: Recipe, b: Recipe) -> list[tuple[str, Any, Any]]:
    """Fields whose values differ: (dotted path, value in a, value in b), sorted by path; `name` excluded."""
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    return [(k, fa.get(k), fb.get(k)) for k in changed_fields(fa, fb) if k != "name"]


def preset_catalogue() -> Presets:
    """Every preset as a recipe mapping with the schema's defaults filled in (pydantic's checks only: a preset's
    cross-field rules and its `dp` are not applied), against the default recipe (`DEFAULT_BASE`) and the files it is
    made of: what `scalerl recipe explain` compares."""

    def filled(data: dict[str, Any]) -> dict[str, Any]:
        return Recipe.model_validate(data).model_dump(mode="json")

    base_file = PRESET_DIR / f"{DEFAULT_BASE}.yaml"
    files = [(f"recipes/{DEFAULT_BASE}.yaml", base_file.read_text())]
    model_preset = _read_mapping(base_file).get("model_preset")
    if isinstance(model_preset, str) and model_preset in model_preset_names():
        files.append((f"recipes/models/{model_preset}.yaml ({DEFAULT_BASE}.yaml's model_preset)",
                      (MODEL_PRESET_DIR / f"{model_preset}.yaml").read_text()))
    return Presets(DEFAULT_BASE, filled(resolve_dict(DEFAULT_BASE)),
                   {name: filled(resolve_dict(name)) for name in preset_names()},
                   {name: filled(resolve_dict(DEFAULT_BASE, model_preset=name)) for name in model_preset_names()},
                   files)
