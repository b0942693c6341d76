"""`SWEEP/sweep.json`: what a sweep is (base, variants, seeds, steps or budget, `--set`) and where each run stands.

    {"schema": "scalerl.sweep/1", "created", "updated",
     "base", "model", "set": [...], "tokenizer", "init_from", "init_fingerprint",
     "steps": N | null, "budget": GPU-hours | null, "seeds": N,
     "slurm": bool, "parallel": N, "max_concurrent": N | null,                # how its runs are launched
     "variants": {NAME: {"source", "overrides": ["key=value", ...]}},          # "base" first
     "runs": {"VARIANT/seedI": {"variant", "seed_index", "seed", "run_dir", "state", "exit_code", "pid",
                                "slurm_job", "finished"}}}

Only the sweep process writes it (atomically, `fileio.atomic_write_json`), under `SWEEP/.sweep.lock` (`SweepLock`:
one sweep process per directory). Run states: `pending` (never started), `queued` (a SLURM job waits), `running`,
`stopped` (interrupted; it resumes), `failed` (ended without finishing; the next `scalerl sweep` resumes it), `done`.
The state is what the sweep last saw; whether a run is done is always read from the run directory itself
(`sweep/runs.py`).

Running `scalerl sweep --sweep-dir DIR` again with the same arguments, fewer, or extended ones (more seeds, more
variants, more steps, a larger budget) merges into it; a different base, model, `--set` or tokenizer, fewer steps
or a smaller budget, a variant whose overrides changed, or `--slurm` on a sweep that runs locally is refused with
the field named. A sweep keeps its launcher: one made with `--slurm` goes on submitting jobs when run again without
it (`--parallel` and `--max-concurrent` may change from one invocation to the next).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_json
from megatron_scalerl.sweep.plan import BASE_VARIANT, Variant

SCHEMA = "scalerl.sweep/1"
MANIFEST = "sweep.json"
LOCK = ".sweep.lock"
STATES = ("pending", "queued", "running", "stopped", "failed", "done")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def manifest_path(sweep_dir: Path) -> Path:
    return sweep_dir / MANIFEST


def load_manifest(sweep_dir: Path) -> dict[str, Any] | None:
    """The sweep's manifest, or None when `sweep_dir` holds no sweep yet."""
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
    return data


def save_manifest(sweep_dir: Path, manifest: dict[str, Any]) -> None:
    manifest["updated"] = _now()
    atomic_write_json(manifest_path(sweep_dir), manifest)


def run_key(variant: str, seed_index: int) -> str:
    """A run's key in the manifest, and its directory under the sweep: `VARIANT/seedI`."""
    return f"{variant}/seed{seed_index}"


def _conflict(path: Path, field: str, old: Any, option: str, new: Any) -> UserError:
    return UserError(f"{path}: field '{field}' is {json.dumps(old)}, and {option} {json.dumps(new)} differs: a sweep "
                     f"keeps its {field} (drop {option} to resume it, or choose another --sweep-dir)")


def merge(sweep_dir: Path, old: dict[str, Any] | None, *, base: str | None, model: str | None,
          sets: list[str], tokenizer: str | None, steps: int | None, budget: float | None, seeds: int | None,
          variants: list[Variant], slurm: bool = False, parallel: int | None = None,
          max_concurrent: int | None = None) -> dict[str, Any]:
    """The manifest after this invocation: `old` (None: a new sweep) with this request merged in. Options left out
    (None, or [] for `sets`) keep the manifest's value; `variants` excludes the base, which every sweep has."""
    path = manifest_path(sweep_dir)
    if old is None:
        if base is None:
            raise UserError(f"{sweep_dir} holds no sweep yet ({MANIFEST}): give --base and the variants")
        old = {"schema": SCHEMA, "created": _now(), "updated": None, "base": base, "model": model, "set": sets,
               "tokenizer": tokenizer, "init_from": None, "init_fingerprint": None, "steps": steps, "budget": budget,
               "seeds": seeds or 1, "slurm": slurm, "parallel": 1, "max_concurrent": None,
               "variants": {BASE_VARIANT: Variant(BASE_VARIANT, "base").to_dict()}, "runs": {}}
    new = json.loads(json.dumps(old))
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
    for field, option, value in (("steps", "--steps", steps), ("budget", "--budget", budget)):
        if value is not None and old.get(field) is not None and value < old[field]:
            raise UserError(f"{path}: field '{field}' is {old[field]:g}; {option} {value:g} would shrink it (a sweep "
                            "extends, never shortens, its runs)")
        if value is not None:
            new[field] = value
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
