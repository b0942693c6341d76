"""`scalerl recipe show | explain | diff | validate | list`: inspect resolved recipes and what their keys mean."""

from __future__ import annotations

import argparse
import json

from megatron_scalerl import recipe as rc
from megatron_scalerl.commands.parsing import command_group
from megatron_scalerl.errors import UserError


def _add_source(p: argparse.ArgumentParser, name: str = "recipe") -> None:
    p.add_argument(name, help="preset name (see `scalerl recipe list`) or recipe YAML file")


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="model_preset",
                   help="model preset to apply (e.g. tiny_dense), or hf:DIR to take the model from an HF checkpoint")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override applied last, e.g. --set trainer.lr=1e-6 (repeatable)")


def register(parser: argparse.ArgumentParser) -> None:
    rsub = command_group(parser, "ACTION")

    show = rsub.add_parser("show", help="print the resolved recipe")
    _add_source(show)
    _add_overrides(show)
    show.add_argument("--json", action="store_true", help="print exactly one JSON object")
    show.add_argument("--plan", action="store_true",
                      help="print the per-GPU memory plan of the trainer and generator layouts instead")
    show.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory the plan is checked against (GiB)")
    show.add_argument("--explain", action="store_true",
                      help="end every line that sets a key with its description (`scalerl recipe explain KEY`)")
    show.set_defaults(func=_show)

    explain = rsub.add_parser("explain", help="what keys mean: description, type, default, presets, rules")
    explain.add_argument("keys", nargs="*", metavar="KEY",
                         help="dotted key or section, e.g. trainer.lr or data.train.kind (none: every key, one line "
                              "each)")
    explain.add_argument("--json", action="store_true", help="print exactly one JSON object")
    explain.set_defaults(func=_explain)

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
    if args.explain and (args.json or args.plan):
        raise UserError("recipe show: --explain annotates the YAML; it does not combine with --json or --plan")
    recipe = rc.load_recipe(args.recipe, args.overrides, args.model_preset)
    if args.plan:
        return _plan(recipe, args.gpu_gib, args.json)
    if args.explain:
        print(rc.annotate_yaml(recipe.to_yaml()), end="")
        return 0
    print(json.dumps(recipe.to_dict()) if args.json else recipe.to_yaml(), end="\n" if args.json else "")
    return 0


def _plan(recipe: rc.Recipe, gpu_gib: float, as_json: bool) -> int:
    """Exit 0 when both layouts fit GPUs of `gpu_gib` GiB, else 1; a layout that does not fit comes with the
    layout changes (`--set`) after which it would (`models.memory_advice`)."""
    from megatron_scalerl.models.memory_advice import (  # deferred: torch; only --plan needs it (`recipe show` stays fast)
        generator_changes,
        kv_change,
        trainer_changes,
    )
    from megatron_scalerl.models.memory_plan import (  # deferred: as the import above
        VLLM_GPU_MEMORY_UTILIZATION,
        generator_plan,
        kv_sequences,
        trainer_plan,
    )

    p = recipe.parallelism
    plans = [(trainer_plan(recipe), 1.0, trainer_changes(recipe, gpu_gib)),
             (generator_plan(recipe), VLLM_GPU_MEMORY_UTILIZATION, generator_changes(recipe, gpu_gib))]
    sequences = kv_sequences(recipe, gpu_gib)
    fits = all(plan.fits(gpu_gib, usable) for plan, usable, _ in plans)
    if as_json:
        print(json.dumps({"recipe": recipe.name, "gpu_gib": gpu_gib, "fits": fits, "kv_sequences": sequences,
                          "plans": [{**plan.as_dict(), "changes": [c.as_dict() for c in changes]}
                                    for plan, _, changes in plans]}))
        return 0 if fits else 1
    experts = f" ep{p.ep} etp{p.expert_tp_size}" if recipe.model.is_moe else ""
    sp = " sp" if p.sequence_parallel and p.tp > 1 else ""
    print(f"{recipe.name}: {recipe.model.arch}, trainer tp{p.tp}{sp} pp{p.pp}{experts} "
          f"dp{p.dp_size(recipe.cluster.trainer_gpus)} on {recipe.cluster.trainer_gpus} GPUs, recompute {p.recompute}; "
          f"generators tp{p.generator_tp} on {recipe.cluster.generator_gpus} GPUs; per-GPU GiB against {gpu_gib:g}")
    for plan, usable, changes in plans:
        print(f"  {plan.what}")
        for part, size in plan.parts.items():
            print(f"    {part:<38} {size / 2**30:8.2f}")
        if plan.beside:
            print("    kept out of vLLM's share (made by weight sync after it starts):")
        for part, size in plan.beside.items():
            print(f"      {part:<36} {size / 2**30:8.2f}")
        verdict = "fits" if plan.fits(gpu_gib, usable) else "DOES NOT FIT"
        print(f"    {'total':<38} {plan.total_gib:8.2f}  {verdict} ({usable:.0%} of {gpu_gib:g} GiB)")
        for note in plan.notes:
            print(f"    ({note})")
        if not plan.fits(gpu_gib, usable):
            _print_changes(changes, gpu_gib * usable, recipe.cluster.gpus_per_node)
    share = -(-recipe.samples_per_step // recipe.generator_servers)
    print(f"  generator KV cache: {sequences} full-length sequences at once per server ({recipe.generator_servers} "
          f"servers; a step's {recipe.samples_per_step} samples are {share} per server)")
    if (more := kv_change(recipe, gpu_gib)) is not None:
        print(f"    (the rest of a server's share waits; --set {more[0]} holds {more[1]} of {more[2]} per server)")
    return 0 if fits else 1


def _print_changes(changes: list, usable_gib: float, gpus_per_node: int) -> None:
    """What to `--set` so that a plan that does not fit would (`models.memory_advice.Change`s)."""
    if not changes:
        print(f"    no layout change applies (the trainer's tensor parallelism within a node's {gpus_per_node} GPUs; "
              "generator_tp up to every generator GPU): larger GPUs (--gpu-gib), shorter sequences "
              "(rollout.max_prompt_tokens, max_new_tokens) or a smaller model")
        return
    fitting = any(c.fits for c in changes)
    print(f"    to fit {usable_gib:.1f} GiB, {'any one of' if fitting else 'nothing tried does; the closest'}:")
    for c in changes:
        print(f"      {' '.join('--set ' + s for s in c.settings):<62} {c.total_gib:8.2f} GiB  {c.why}")


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


def _explain(args: argparse.Namespace) -> int:
    """Each KEY explained (unknown keys: an error naming the nearest known ones), or every key on one line."""
    presets = rc.preset_catalogue()
    found = [rc.explain_key(key, presets) for key in args.keys]
    if args.json:
        print(json.dumps({"keys": [e.as_dict() for e in found]} if args.keys else
                         {"keys": [rc.explain_key(key, presets).as_dict() for key in rc.schema_keys()]}))
    else:
        print("\n\n".join(e.text() for e in found) if args.keys else rc.key_table(presets))
    return 0


def _list(args: argparse.Namespace) -> int:
    print("run presets:   " + " ".join(rc.preset_names()))
    print("model presets: " + " ".join(rc.model_preset_names()))
    return 0
