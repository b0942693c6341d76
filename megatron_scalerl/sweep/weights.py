"""The initial weights every run of a sweep starts from (`trainer.init_from`), decided once and checked after.

- the base recipe (with `--model` and `--set`) names `trainer.init_from` (or `--model hf:DIR` set it): those;
- else the weights its preset offers to runs that name none (`demo.run.PRESET_WEIGHTS`: on `--base demo`, the demo's
  warm-started model, `demo.run.demo_preset_weights`, built on first use);
- else the sweep is refused: runs started from random weights would each start from their own.

The sweep records the directory and a fingerprint of its files (relative path, bytes, modification time) in
sweep.json. A later invocation that would start new runs (more seeds, another variant) checks it: weights rebuilt or
replaced since the sweep began would break the comparison, and are refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from megatron_scalerl.demo.run import PRESET_WEIGHTS
from megatron_scalerl.errors import UserError


def fingerprint(directory: Path) -> str:
    """SHA-256 over the sorted (relative path, size in bytes, mtime in ns) of every file under `directory`: cheap
    for an 8B checkpoint, and changed by any rebuild or copy over it."""
    if not directory.is_dir():
        raise UserError(f"initial weights {directory}: no such directory")
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(directory)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def decide_init_from(base: str, base_dict: dict[str, Any]) -> Path:
    """Where the sweep's runs start from (see the module docstring); builds a preset's offered weights when needed."""
    given = (base_dict.get("trainer") or {}).get("init_from")
    if given:
        return Path(given).resolve()
    if base in PRESET_WEIGHTS:
        return PRESET_WEIGHTS[base](base_dict).resolve()
    raise UserError(f"base {base} starts from random weights (trainer.init_from is null): a sweep needs "
                    "trainer.init_from (--set trainer.init_from=DIR) or --model hf:DIR, so that all its runs start "
                    "from the same weights")


def check_init_from(manifest: dict[str, Any], sweep_file: Path) -> None:
    """Refuse to start new runs when the recorded initial weights are gone or changed since the sweep began."""
    directory = Path(manifest["init_from"])
    if not directory.is_dir():
        raise UserError(f"{sweep_file}: field 'init_from' names {directory}, which is gone: the sweep's remaining "
                        "runs cannot start from the weights its other runs started from")
    if fingerprint(directory) != manifest["init_fingerprint"]:
        raise UserError(f"{sweep_file}: the initial weights in {directory} (field 'init_from') changed since the sweep "
                        "began (their files' sizes or times differ): new runs would not start from the same weights "
                        "as the others; restore them, or start another --sweep-dir")
