"""`scalerl recipe show | diff | validate`: inspect resolved recipes."""

from __future__ import annotations

import argparse
import json

from megatron_scalerl import recipe as rc
from megatron_scalerl.cli import command_group


def _add_source(p: argparse.ArgumentParser, name: str = "recipe") -> None:
    p.add_argument(name, help="preset name (see `scalerl recipe list`) or recipe YAML file")


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="model_preset",
                   help="model preset to apply (e.g. tiny_dense), or hf:DIR to take the model from an HF checkpoint")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override applied last, e.g. --set trainer.lr=1e-6 (repeatable)")


def register(sub: argparse._SubParsersAction) -> None:
    rsub = command_group(sub, "recipe", "show, compare and validate recipes", "ACTION")

    show = rsub.add_parser("show", help="print the resolved recipe")
    _add_source(show)
    _add_overrides(show)
    show.add_argument("--json", action="store_true", help="print exactly one JSON object")
    show.set_defaults(func=_show)

    diff = rsub.add_parser("diff", help="list the fields where two recipes differ")
    _add_source(diff, "a")
    _add_source(diff, "b")
    diff.add_argument("--json", action="store_true")
    diff.set_defaults(func=_diff)

    validate = rsub.add_parser("validate", help="check a recipe file; exit 0 when valid")
    _add_source(validate)
    _add_overrides(validate)
    validate.set_defaults(func=_validate)

    lst = rsub.add_parser("list", help="list run presets and model presets")
    lst.set_defaults(func=_list)


def _show(args: argparse.Namespace) -> int:
    recipe = rc.load_recipe(args.recipe, args.overrides, args.model_preset)
    print(json.dumps(recipe.to_dict()) if args.json else recipe.to_yaml(), end="\n" if args.json else "")
    return 0


def _diff(args: argparse.Namespace) -> int:
    a, b = rc.load_recipe(args.a), rc.load_recipe(args.b)
    rows = rc.diff(a, b)
    if args.json:
        print(json.dumps({"a": a.name, "b": b.name, "differences": [
            {"path": path, "a": va, "b": vb} for path, va, vb in rows]}))
        return 0
    if not rows:
        print(f"{a.name} and {b.name} are identical")
        return 0
    width = max(len(p) for p, _, _ in rows)
    print(f"{'field':<{width}}  {a.name}  ->  {b.name}")
    for path, va, vb in rows:
        print(f"{path:<{width}}  {va!r}  ->  {vb!r}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    recipe = rc.load_recipe(args.recipe, args.overrides, args.model_preset)
    p = recipe.parallelism
    print(f"ok: {recipe.name} ({recipe.model.arch}, tp{p.tp} pp{p.pp} ep{p.ep} dp{p.dp}, "
          f"{recipe.samples_per_step} samples/step, {recipe.cluster.total_gpus} GPUs)")
    return 0


def _list(args: argparse.Namespace) -> int:
    print("run presets:   " + " ".join(rc.preset_names()))
    print("model presets: " + " ".join(rc.model_preset_names()))
    return 0
