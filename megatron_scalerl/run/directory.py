"""Files of the run directory that several roles share (the full contract: docs/design.md, "The run directory").

    RUN/generators.json   {"urls": [...], "dtype": "float32"}: the run's generator servers and their serving dtype,
                          written by the launcher, read by the trainer (weight sync) and the orchestrator (fleet).
    RUN/stop_requested    the request that the trainer stop, from the launcher (on a stop) or the orchestrator (the
                          run ended early): it checkpoints at its next batch boundary and exits 0, with no signal
                          sent into torchrun or a collective (SIGTERM does the same for anyone else); the launcher
                          removes it before it starts a trainer.
    RUN/finished.json     {"reason", "step", "gpu_hours"}: written by the orchestrator when the run has ended on its
                          own (`max_steps`, `max_gpu_hours` or `stop_at_fraction`), never on a stop from outside;
                          what tells a sweep (or a script) that the run is done. Removed when the run is resumed.
    RUN/orchestrator.heartbeat  moved (its modification time) by the orchestrator every few seconds while it runs,
                          whose own deadline ends it when its generation stops moving; the trainer waits for a
                          batch as long as it moves (`run.deadlines.Heartbeat`).
    RUN/restart_generator/<i>.json  {"url", "cause", "again"}: the trainer's request that the launcher start
                          generator i again, which cannot take the trainer's weights (`again`: it was started again
                          for that already and failed once more: the launcher ends the run, naming it and the
                          cause); the launcher removes it once acted on (`request_generator_restart`,
                          `generator_restart_requests`, `take_generator_restart`).
    RUN/api_key           the run's own API key (`secrets.token_urlsafe(32)`, 256 random bits), mode 0600, made by
                          the run's first launch that finds no `$SCALERL_API_KEY` and read again by every later one
                          (`--resume`, a requeued job): `run_api_key`.

Every launch has an API key: the user's (`$SCALERL_API_KEY` in the launcher's environment, never written anywhere)
or the run's own (`RUN/api_key`). The launcher hands it to every role in `$SCALERL_API_KEY` (never on a command line,
which `ps` shows to every user of the machine); generators ask for it on every route but /health, the trainer,
orchestrator and supervisor present it.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from collections.abc import Mapping
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_text

RECIPE_FILE = "recipe.yaml"  # the run's recipe, precision resolved; written once by the launcher (launch/roles.py)
GENERATORS_FILE = "generators.json"
STOP_FILE = "stop_requested"
FINISHED_FILE = "finished.json"
# The orchestrator's state (prompt sampler, No-Positive-Resampling history, pending prompts), written atomically
# before each batch, the previous one kept beside it; each trainer checkpoint holds a copy, the state a resume from
# that checkpoint continues from (orchestrator/state.py).
CURRICULUM_FILE, PREVIOUS_CURRICULUM_FILE = "curriculum.json", "curriculum.prev.json"
HEARTBEAT_FILE = "orchestrator.heartbeat"
RESTART_GENERATOR_DIR = "restart_generator"
STOP_TIMEOUT_S = 120.0  # seconds a role gets to stop cleanly (the trainer's last checkpoint) before SIGKILL
FINISH_REASONS = ("max_steps", "max_gpu_hours", "stop_at_fraction")
API_KEY_ENV = "SCALERL_API_KEY"
API_KEY_FILE = "api_key"
SERVING_DTYPES = ("float32", "bfloat16", "float16")


def write_generators(run_dir: str | Path, urls: list[str], dtype: str) -> Path:
    """Record the run's generators (base URLs) and their serving dtype (one of SERVING_DTYPES)."""
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"serving dtype {dtype!r} is not one of {SERVING_DTYPES}")
    path = Path(run_dir) / GENERATORS_FILE
    atomic_write_text(path, json.dumps({"urls": urls, "dtype": dtype}, indent=1) + "\n")
    return path


def read_generators(run_dir: str | Path) -> tuple[list[str], str] | None:
    """(urls, dtype) from `RUN/generators.json`, or None when the run has none (the trainer then trains alone)."""
    path = Path(run_dir) / GENERATORS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        urls, dtype = [str(u).rstrip("/") for u in record["urls"]], str(record["dtype"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: expected {{\"urls\": [...], \"dtype\": ...}}: {type(exc).__name__}: {exc}") from None
    if not urls or dtype not in SERVING_DTYPES:
        raise UserError(f"{path}: needs at least one URL and a dtype in {SERVING_DTYPES} (got {urls!r}, {dtype!r})")
    return urls, dtype


def request_stop(run_dir: str | Path) -> bool:
    """Ask the run's trainer to stop (see STOP_FILE); True: asked (a `Role.terminate`)."""
    (Path(run_dir) / STOP_FILE).touch()
    return True


def clear_stop_request(run_dir: str | Path) -> None:
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


def stop_requested(run_dir: str | Path) -> bool:
    return (Path(run_dir) / STOP_FILE).exists()


def request_generator_restart(run_dir: str | Path, index: int, url: str, cause: str, *, again: bool) -> Path:
    """The trainer asks the launcher to start generator `index` (`url`) again: it cannot take the weights
    (`cause`); `again`: it was started again for that before and has taken none since (the launcher ends the run)."""
    path = Path(run_dir) / RESTART_GENERATOR_DIR / f"{int(index)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"url": url, "cause": cause, "again": bool(again)}) + "\n")
    return path


def generator_restart_requests(run_dir: str | Path) -> dict[int, dict]:
    """The open requests of `request_generator_restart`, by generator index (one being written is left for later)."""
    found = {}
    for path in sorted((Path(run_dir) / RESTART_GENERATOR_DIR).glob("*.json")):
        try:
            found[int(path.stem)] = json.loads(path.read_text())
        except (ValueError, OSError):  # not ours, or gone meanwhile
            continue
    return found


def take_generator_restart(run_dir: str | Path, index: int) -> None:
    """The launcher acted on generator `index`'s request (or clears a stale one)."""
    (Path(run_dir) / RESTART_GENERATOR_DIR / f"{int(index)}.json").unlink(missing_ok=True)


def write_finished(run_dir: str | Path, reason: str, step: int, gpu_hours: float) -> Path:
    """Record that the run ended on its own after `step` batches at `gpu_hours` (the orchestrator's clock), for
    `reason` (one of FINISH_REASONS)."""
    if reason not in FINISH_REASONS:
        raise ValueError(f"finish reason {reason!r} is not one of {FINISH_REASONS}")
    path = Path(run_dir) / FINISHED_FILE
    atomic_write_text(path, json.dumps({"reason": reason, "step": int(step), "gpu_hours": float(gpu_hours)},
                                       indent=1) + "\n")
    return path


def read_finished(run_dir: str | Path) -> dict | None:
    """`RUN/finished.json` ({"reason", "step", "gpu_hours"}), or None while the run has not ended on its own."""
    path = Path(run_dir) / FINISHED_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        finished = {"reason": str(record["reason"]), "step": int(record["step"]),
                    "gpu_hours": float(record["gpu_hours"])}
        if finished["reason"] not in FINISH_REASONS:
            raise ValueError(f"reason {finished['reason']!r} is not one of {FINISH_REASONS}")
        return finished
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: expected {{\"reason\", \"step\", \"gpu_hours\"}}: {type(exc).__name__}: {exc}") from None


def clear_finished(run_dir: str | Path) -> None:
    (Path(run_dir) / FINISHED_FILE).unlink(missing_ok=True)


def run_api_key(run_dir: str | Path, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(key, where it came from) for a launch of the run in `run_dir`: `$SCALERL_API_KEY` of `env` (default: this
    process's environment) when set, else the run's own `RUN/api_key`, created here on the run's first launch
    (O_EXCL-style: written to a 0600 temp file, then linked into place, so two launchers never see two keys or a torn
    one)."""
    env = os.environ if env is None else env
    if env.get(API_KEY_ENV):
        return env[API_KEY_ENV], f"${API_KEY_ENV}"
    path = Path(run_dir) / API_KEY_FILE
    if not path.exists():
        _create_key_file(path)
    return read_api_key_file(path), str(path)


def _create_key_file(path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)  # atomic, and never replaces a key another launcher made meanwhile
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def read_api_key_file(path: str | Path) -> str:
    """The API key in file `path` (its first line, whitespace stripped). UserError naming the file when it cannot be
    read, is empty, or is readable by other users than its owner (group or other permission bits: `chmod 600` it)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"API key file {path}: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise UserError(f"API key file {path}: other users may read it (mode {mode:03o}); chmod 600 {path}")
    key = (text.strip().splitlines() or [""])[0].strip()
    if not key:
        raise UserError(f"API key file {path} is empty")
    return key
