"""`SWEEP/sweep.json`: what a sweep is (base, variants, seeds, steps or budget, `--set`) and where each run stands.

    {"schema": "scalerl.sweep/1", "created", "updated",
     "base", "model", "set": [...], "tokenizer", "init_from", "init_fingerprint",
     "base_recipe": {"dotted.field": value, ...},                               # the base recipe as the sweep began
     "steps": N | null, "budget": GPU-hours | null, "seeds": N,
     "slurm": bool, "parallel": N, "max_concurrent": N | null,                # how its runs are launched
     "variants": {NAME: {"source", "overrides": ["key=value", ...]}},          # "base" first
     "runs": {"VARIANT/seedI": {"variant", "seed_index", "seed", "run_dir", "state", "exit_code", "pid",
                                "slurm_job", "finished"}}}

Only the sweep process writes it (atomically, `fileio.atomic_write_json`), under `SWEEP/.sweep.lock` (`SweepLock`:
one sweep process per directory); a damaged entry is refused on load, naming the file and the field. Run states:
`pending` (never started), `queued` (a SLURM job waits), `running`, `stopped` (interrupted; it resumes), `failed`
(ended without finishing; the next `scalerl sweep` resumes it), `done`. The state is what the sweep last saw; whether
a run is done is always read from the run directory itself (`sweep/runs.py`).

`base_recipe` is the base recipe (after `--model` and `--set`) flattened to its dotted fields, without `name`,
`trainer.init_from`, `trainer.seed`, `trainer.max_steps` and `trainer.max_gpu_hours` (set per run by the sweep):
new runs are refused once it differs from the base recipe now (`check_base_recipe`: its preset or file was edited).

Running `scalerl sweep --sweep-dir DIR` again with the same arguments, fewer, or extended ones (more seeds, more
variants, more steps, a larger budget) merges into it; a different base, model, `--set` or tokenizer, fewer steps
than before (or than the recipe's trainer.max_steps the runs took without `--steps`), a smaller budget, a first
budget once runs have finished without one, a variant whose overrides changed, or `--slurm` on a sweep that runs
locally is refused with the field named. A sweep keeps its launcher: one made with `--slurm` goes on submitting jobs
when run again without it (`--parallel` and `--max-concurrent` may change from one invocation to the next).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path, PurePosixPath
from typing import Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_json
from megatron_scalerl.recipe import changed_fields
from megatron_scalerl.recipe.variants import respell_flat
from megatron_scalerl.run.directory import read_finished
from megatron_scalerl.sweep.plan import BASE_VARIANT, Variant

SCHEMA = "scalerl.sweep/1"
MANIFEST = "sweep.json"
LOCK = ".sweep.lock"
STATES = ("pending", "queued", "running", "stopped", "failed", "done")
_OPTIONAL_INT = (int, type(None))
VARIANT_FIELDS = {"source": (str,), "overrides": (list,)}
RUN_FIELDS = {"variant": (str,), "seed_index": (int,), "seed": _OPTIONAL_INT, "run_dir": (str,), "state": (str,),
              "exit_code": _OPTIONAL_INT, "pid": _OPTIONAL_INT, "slurm_job": _OPTIONAL_INT,
              "finished": (dict, type(None))}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def manifest_path(sweep_dir: Path) -> Path:
    return sweep_dir / MANIFEST


def load_manifest(sweep_dir: Path) -> dict[str, Any] | None:
    """The sweep's manifest, or None when `sweep_dir` holds no sweep yet; UserError naming the field when it is
    damaged."""
    path = manifest_path(sweep_dir)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise UserError(f"{path}: not a sweep manifest (field 'schema' must be {SCHEMA!r}, got "
                        f"{data.get('schema') if isinstance(data, dict) else type(data).__name__!r})")
    missing = [k for k in ("base", "set", "seeds", "slurm", "variants", "runs") if k not in data]
    if missing:
        raise UserError(f"{path}: missing field(s) {', '.join(missing)}")
    _check_entries(path, data)
    return data


def _check_fields(path: Path, where: str, entry: Any, fields: dict[str, tuple[type, ...]]) -> None:
    if not isinstance(entry, dict):
        raise UserError(f"{path}: field '{where}' must be an object, got {json.dumps(entry)}")
    for name, types in fields.items():
        if name not in entry:
            raise UserError(f"{path}: field '{where}.{name}' is missing")
        value = entry[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise UserError(f"{path}: field '{where}.{name}' is {json.dumps(value)}: expected "
                            f"{' or '.join('null' if t is type(None) else t.__name__ for t in types)}")


def _check_entries(path: Path, data: dict[str, Any]) -> None:
    """Refuse a damaged manifest (edited by hand, written by something else) naming the field, before anything
    acts on it: its runs' directories are created and, when cut short at their first start, removed."""
    if not isinstance(data["seeds"], int) or isinstance(data["seeds"], bool) or data["seeds"] < 1:
        raise UserError(f"{path}: field 'seeds' is {json.dumps(data['seeds'])}: expected an integer >= 1")
    if not isinstance(data["set"], list) or not all(isinstance(s, str) for s in data["set"]):
        raise UserError(f"{path}: field 'set' is {json.dumps(data['set'])}: expected a list of \"key=value\" strings")
    for field in ("variants", "runs"):
        if not isinstance(data[field], dict):
            raise UserError(f"{path}: field '{field}' must be an object, got {json.dumps(data[field])}")
    if BASE_VARIANT not in data["variants"]:
        raise UserError(f"{path}: field 'variants.{BASE_VARIANT}' is missing (every sweep has its base)")
    for name, entry in data["variants"].items():
        _check_fields(path, f"variants.{name}", entry, VARIANT_FIELDS)
        if not all(isinstance(o, str) for o in entry["overrides"]):
            raise UserError(f"{path}: field 'variants.{name}.overrides' is {json.dumps(entry['overrides'])}: "
                            "expected a list of \"key=value\" strings")
    for key, entry in data["runs"].items():
        where = f"runs.{key}"
        _check_fields(path, where, entry, RUN_FIELDS)
        if entry["variant"] not in data["variants"]:
            raise UserError(f"{path}: field '{where}.variant' is {json.dumps(entry['variant'])}: not one of the "
                            f"sweep's variants ({', '.join(data['variants'])})")
        if entry["seed_index"] < 0 or key != run_key(entry["variant"], entry["seed_index"]):
            raise UserError(f"{path}: field '{where}.seed_index' is {entry['seed_index']}: the run's key must be "
                            f"VARIANT/seedI of its variant and seed index")
        run_dir = PurePosixPath(entry["run_dir"])
        if not entry["run_dir"] or run_dir.is_absolute() or ".." in run_dir.parts:
            raise UserError(f"{path}: field '{where}.run_dir' is {json.dumps(entry['run_dir'])}: expected a path "
                            "inside the sweep directory (relative, without '..')")
        if entry["state"] not in STATES:
            raise UserError(f"{path}: field '{where}.state' is {json.dumps(entry['state'])}: expected one of "
                            f"{', '.join(STATES)}")


def save_manifest(sweep_dir: Path, manifest: dict[str, Any]) -> None:
    manifest["updated"] = _now()
    atomic_write_json(manifest_path(sweep_dir), manifest)


def run_key(variant: str, seed_index: int) -> str:
    """A run's key in the manifest, and its directory under the sweep: `VARIANT/seedI`."""
    return f"{variant}/seed{seed_index}"


def _conflict(path: Path, field: str, old: Any, option: str, new: Any) -> UserError:
    return UserError(f"{path}: field '{field}' is {json.dumps(old)}, and {option} {json.dumps(new)} differs: a sweep "
                     f"keeps its {field} (drop {option} to resume it, or choose another --sweep-dir)")


def _shrink(path: Path, field: str, old: str, option: str, value: float) -> UserError:
    return UserError(f"{path}: field '{field}' is {old}; {option} {value:g} would shrink it (a sweep extends, never "
                     "shortens, its runs)")


def merge(sweep_dir: Path, old: dict[str, Any] | None, *, base: str | None, model: str | None,
          sets: list[str], tokenizer: str | None, steps: int | None, budget: float | None, seeds: int | None,
          variants: list[Variant], slurm: bool = False, parallel: int | None = None,
          max_concurrent: int | None = None, recipe_steps: int | None = None,
          base_recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest after this invocation: `old` (None: a new sweep) with this request merged in. Options left out
    (None, or [] for `sets`) keep the manifest's value; `variants` excludes the base, which every sweep has.
    `recipe_steps`: the base recipe's trainer.max_steps (what its runs take without `--steps`); `base_recipe`: its
    fields (`plan.base_fields`), recorded for a new sweep (or one whose manifest predates the field)."""
    path = manifest_path(sweep_dir)
    if old is None:
        if base is None:
            raise UserError(f"{sweep_dir} holds no sweep yet ({MANIFEST}): give --base and the variants")
        old = {"schema": SCHEMA, "created": _now(), "updated": None, "base": base, "model": model, "set": sets,
               "tokenizer": tokenizer, "init_from": None, "init_fingerprint": None, "base_recipe": base_recipe,
               "steps": steps, "budget": budget, "seeds": seeds or 1, "slurm": slurm, "parallel": 1,
               "max_concurrent": None, "variants": {BASE_VARIANT: Variant(BASE_VARIANT, "base").to_dict()}, "runs": {}}
    new = json.loads(json.dumps(old))
    if new.get("base_recipe") is None:
        new["base_recipe"] = base_recipe
    if slurm and not old["slurm"]:
        raise UserError(f"{path}: field 'slurm' is false: this sweep runs its runs on this machine; --slurm cannot "
                        "take it over (choose another --sweep-dir)")
    for field, value in (("parallel", parallel), ("max_concurrent", max_concurrent)):
        if value is not None:
            new[field] = value
    for field, option, value in (("base", "--base", base), ("model", "--model", model),
                                 ("tokenizer", "--tokenizer", tokenizer)):
        if value is not None and value != old.get(field):
            raise _conflict(path, field, old.get(field), option, value)
    if sets and sets != old["set"]:
        raise _conflict(path, "set", old["set"], "--set", sets)
    if steps is not None:
        if old.get("steps") is not None and steps < old["steps"]:
            raise _shrink(path, "steps", f"{old['steps']}", "--steps", steps)
        if old.get("steps") is None and recipe_steps is not None and steps < recipe_steps:
            raise _shrink(path, "steps", f"null (the runs take the base recipe's trainer.max_steps, {recipe_steps})",
                          "--steps", steps)
        new["steps"] = steps
    if budget is not None:
        if old.get("budget") is not None and budget < old["budget"]:
            raise _shrink(path, "budget", f"{old['budget']:g}", "--budget", budget)
        ended = [key for key, entry in old["runs"].items() if read_finished(sweep_dir / entry["run_dir"])]
        if old.get("budget") is None and ended:
            raise UserError(f"{path}: field 'budget' is null and {len(ended)} run(s) already finished without one "
                            f"({', '.join(sorted(ended)[:3])}{' ...' if len(ended) > 3 else ''}): --budget would end "
                            "the others by a rule those did not have (extend the sweep with --steps, or choose "
                            "another --sweep-dir)")
        new["budget"] = budget
    new["seeds"] = max(old["seeds"], seeds or 0)
    for variant in variants:
        known = old["variants"].get(variant.name)
        if known is not None and known["overrides"] != list(variant.overrides):
            raise UserError(f"{path}: field 'variants.{variant.name}.overrides' is {json.dumps(known['overrides'])}, "
                            f"but {variant.source} now gives {json.dumps(list(variant.overrides))} (did its preset "
                            "change?): give the new one another name, or choose another --sweep-dir")
        new["variants"].setdefault(variant.name, variant.to_dict())
    for seed_index in range(new["seeds"]):
        for name in new["variants"]:
            new["runs"].setdefault(run_key(name, seed_index), {
                "variant": name, "seed_index": seed_index, "seed": None, "run_dir": run_key(name, seed_index),
                "state": "pending", "exit_code": None, "pid": None, "slurm_job": None, "finished": None})
    return new


def check_base_recipe(manifest: dict[str, Any], current: dict[str, Any], sweep_file: Path) -> None:
    """Refuse to start new runs when the base recipe's fields now (`current`, `plan.base_fields`) differ from those
    the sweep recorded (field 'base_recipe'), naming the fields that changed."""
    recorded, absent = respell_flat(manifest["base_recipe"]), "(absent)"  # a sweep begun before the variants
    changed = changed_fields(recorded, current)
    if changed:
        shown = "; ".join(f"{k}: {json.dumps(recorded.get(k, absent))} -> {json.dumps(current.get(k, absent))}"
                          for k in changed[:5])
        raise UserError(f"{sweep_file}: the base recipe changed since the sweep began (field 'base_recipe'; {shown}"
                        f"{f'; +{len(changed) - 5} more' if len(changed) > 5 else ''}): new runs would not be the "
                        "runs the others are; restore its preset or file, or start another --sweep-dir")


def ordered_runs(manifest: dict[str, Any]) -> list[str]:
    """Run keys in the order they are started: seed 0 of every variant (the base first), then seed 1, ...: a sweep
    cut short has whole comparisons rather than every seed of a few variants."""
    return sorted(manifest["runs"], key=lambda key: (manifest["runs"][key]["seed_index"],
                                                     list(manifest["variants"]).index(manifest["runs"][key]["variant"])))


class SweepLock:
    """Holds `SWEEP/.sweep.lock` (flock) while a sweep process works on the directory; the kernel releases it when
    the process ends, however it ends."""

    def __init__(self, sweep_dir: Path):
        self.path = sweep_dir / LOCK
        self.fd: int | None = None

    def __enter__(self) -> SweepLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UserError(f"another scalerl sweep (pid {holder}) is working on {self.path.parent}: wait for it or "
                            "stop it first") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
