"""Checkpoint directories: atomic publication, checksummed manifests, fallback past corrupt checkpoints.

Layout under the run directory:

    checkpoints/iter_0000100/         one checkpoint (iteration = optimizer steps taken)
        <Megatron dist_checkpointing files>   model + optimizer, sharded by the writer
        rl_state.json                  step state, compute, model section, and a copy of the orchestrator's
                                       state (`curriculum`, what a resume from here continues from) (rank 0)
        rng/rank_00000.pt              per-rank RNG states
        manifest.json                  {"iteration", "files": {relpath: {"bytes", "sha256"}}}, written last
    checkpoints/unusable/iter_0000200/ a checkpoint set aside (corrupt, or from an abandoned timeline), with
        UNUSABLE.txt                   why and when; never loaded, never pruned (delete it by hand once read)

A checkpoint is written into `checkpoints/.iter_NNNNNNN.partial/` by all ranks, hashed (files split across ranks),
given its manifest and renamed into place by rank 0. A directory without a valid manifest never counts: on load,
the newest checkpoint whose files all match their manifest wins, and each one skipped is reported with the reason
(and, when resuming, set aside under `unusable/`). After a save, the `keep` newest checkpoints up to the one just
written stay; older ones are deleted, and any newer one (left by a timeline the run abandoned) is set aside, so the
checkpoint just written is never the one removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_json, atomic_write_text, fsync_dir, fsync_file, replace_durably
from megatron_scalerl.platform.distributed import all_gathered, barrier, from_rank0, rank, world_size

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RL_STATE = "rl_state.json"
UNUSABLE_DIR = "unusable"
UNUSABLE_REASON = "UNUSABLE.txt"


class CheckpointError(UserError):
    """No usable checkpoint, or a checkpoint that does not fit the run; the message names the directory."""


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


class Publication:
    """One checkpoint on its way into place; every method is collective. `Publication(final, rl_state)` makes
    `.<name>.partial` beside `final`; `write(step)` runs `step()` on every rank to write their files into `tmp` (at
    once, or later: megatron-core's asynchronous save finishes a write it started earlier); `complete()` adds
    `rl_state.json` (rank 0), fsyncs and hashes the files (split between the ranks), writes the manifest
    (`manifest_fields` + files) last on rank 0, fsyncs the folders and renames the directory into place (then fsyncs
    `checkpoints/`: the checkpoint published survives a crash whole). A directory already at `final`
    is replaced only once the new one is complete. A write that fails on any rank (a full disk) fails the save on
    every rank alike with CheckpointError naming the rank and the cause; the partial copy is removed (its space
    freed), earlier checkpoints are untouched."""

    def __init__(self, final: Path, rl_state: dict):
        self.final, self.tmp, self.rl_state = final, final.parent / f".{final.name}.partial", rl_state
        if rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)  # leftovers of a crash mid-save
            self.tmp.mkdir(parents=True)
        barrier()

    def write(self, step: Callable[[], object]) -> None:
        _agree(self.final, self.tmp, step)

    def complete(self, manifest_fields: dict) -> Path:
        tmp, final = self.tmp, self.final
        self.write(lambda: atomic_write_json(tmp / RL_STATE, self.rl_state) if rank() == 0 else None)
        files = from_rank0(sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
                           if rank() == 0 else None)
        mine = {rel: _settled_entry(tmp / rel) for rel in files[rank()::world_size()]}
        gathered = all_gathered(mine)

        def finish() -> None:
            if rank() != 0:
                return
            entries = {k: v for part in gathered for k, v in part.items()}
            atomic_write_json(tmp / MANIFEST, {**manifest_fields, "created": time.time(),
                                               "files": dict(sorted(entries.items()))})
            for folder in (tmp, *(p for p in tmp.rglob("*") if p.is_dir())):  # the files: in `_settled_entry`
                fsync_dir(folder)
            replaced = final.parent / f".{final.name}.replaced"
            if final.exists():  # re-saving an iteration (e.g. after a resume): the old copy stays until the new is in
                shutil.rmtree(replaced, ignore_errors=True)
                replace_durably(final, replaced)
            replace_durably(tmp, final)
            shutil.rmtree(replaced, ignore_errors=True)

        self.write(finish)
        return final


def _settled_entry(path: Path) -> dict:
    """The manifest entry of `path` (bytes, sha256), its content fsynced first: whichever rank wrote it, the file is
    on disk before the manifest vouches for it."""
    fsync_file(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def publish(final: Path, write: Callable[[Path], None], rl_state: dict, manifest_fields: dict) -> Path:
    """Collective. Publish checkpoint directory `final` atomically (`Publication`): every rank calls `write(tmp_dir)`
    for its files, in place."""
    publication = Publication(final, rl_state)
    publication.write(lambda: write(publication.tmp))
    return publication.complete(manifest_fields)


def _agree(final: Path, tmp: Path, step: Callable[[], object]) -> None:
    """Collective: run `step` on every rank; when it raised on any (an OSError of our own writes; megatron-core's
    save reports a full disk as torch's CheckpointException), remove `tmp` and raise CheckpointError on every rank
    (naming `final`, the ranks and their errors)."""
    try:
        step()
        failure = None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch's CheckpointException is a BaseException; every rank must hear of it
        failure = f"rank {rank()}: {_describe(exc)}"
    failures = [f for f in all_gathered(failure) if f]
    if failures:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        raise CheckpointError(f"{final}: could not be written ({'; '.join(failures[:3])}); its partial copy was "
                              "removed, the earlier checkpoints are untouched")


def _describe(exc: BaseException) -> str:
    """One line per cause: torch's CheckpointException lists each rank's own failure (`failures`), whose text
    would otherwise be buried in the tracebacks it prints."""
    causes = getattr(exc, "failures", None)
    if isinstance(causes, dict) and causes:
        causes = {r: e[0] if isinstance(e, tuple) else e for r, e in causes.items()}  # (exception, its stack)
        return "; ".join(f"writer of rank {r}: {type(e).__name__}: {e}" for r, e in sorted(causes.items()))
    return f"{type(exc).__name__}: {exc}"


def checkpoint_problems(path: Path, *, checksums: bool = True, collective: bool = False) -> list[str]:
    """`CheckpointStore.problems` of `path` (empty: complete). `collective`: every rank calls it, the ranks split the
    hashing (each checks every world-size-th file) and all get the same answer."""
    if not path.is_dir():
        return ["no such directory"]
    if not collective:
        return CheckpointStore.problems(path, checksums=checksums)
    parts = all_gathered(CheckpointStore.problems(path, checksums=checksums, share=(rank(), world_size())))
    return list(dict.fromkeys(p for part in parts for p in part))


def require_complete(path: Path, *, checksums: bool = True, name: str | None = None, collective: bool = False) -> None:
    """Raise CheckpointError, naming `name` (default: the path), unless `path` is a complete checkpoint: every file
    of its manifest present with its size (and its SHA-256 with `checksums`); `collective`: see
    `checkpoint_problems`."""
    problems = checkpoint_problems(path, checksums=checksums, collective=collective)
    if problems:
        raise CheckpointError(f"{name or path}: not a complete checkpoint ({'; '.join(problems[:3])}){_hint(path)}")


def _hint(path: Path) -> str:
    """What a directory without a manifest is likely to be instead of a Megatron checkpoint."""
    if (path / MANIFEST).is_file() or not path.is_dir():
        return ""
    if (path / "config.json").is_file():
        return "; it is a Hugging Face checkpoint directory (scalerl convert hf-to-megatron makes one from it)"
    if (path / "checkpoints").is_dir():
        return f"; it is a run directory: its checkpoints are {path / 'checkpoints'}/iter_NNNNNNN"
    return ""


class CheckpointStore:
    """The `checkpoints/` folder of one run. Every rank constructs it; collective methods say so."""

    def __init__(self, run_dir: str | Path, keep: int, keep_every: int | None = None):
        """`keep`: the newest checkpoints kept (those a resume uses); `keep_every`: also keep each checkpoint whose
        iteration is a multiple of it (for evaluation), never pruned."""
        self.dir = Path(run_dir) / "checkpoints"
        self.keep, self.keep_every = keep, keep_every

    def path(self, iteration: int) -> Path:
        return self.dir / f"iter_{iteration:07d}"

    def iterations(self) -> list[int]:
        """Published iterations, newest first (validity not checked)."""
        out = []
        for p in self.dir.glob("iter_*"):
            suffix = p.name.removeprefix("iter_")
            if p.is_dir() and suffix.isdigit():
                out.append(int(suffix))
        return sorted(out, reverse=True)

    # -- writing (collective) -------------------------------------------------------------------------------

    def save(self, iteration: int, write: Callable[[Path], None], rl_state: dict) -> Path:
        """Collective: every rank calls `write(tmp_dir)` for its shards; returns the published directory."""
        publication = self.start(iteration, rl_state)
        publication.write(lambda: write(publication.tmp))
        return self.finish(iteration, publication)

    def start(self, iteration: int, rl_state: dict) -> Publication:
        """Collective: checkpoint `iteration` begun (`Publication`); its files are written through it, then
        `finish` publishes it. CheckpointError on every rank, before anything is written, when the disk has less
        room than the newest checkpoint took (`_space_problem`)."""
        problem = from_rank0(self._space_problem(iteration) if rank() == 0 else None)
        if problem:
            raise CheckpointError(problem)
        return Publication(self.path(iteration), rl_state)

    def _space_problem(self, iteration: int) -> str | None:
        """Rank 0: why checkpoint `iteration` would not fit (free space below the size of the newest checkpoint, by
        its manifest), or None. Checked first because megatron-core writes some files on rank 0 alone, between
        collectives: a write failing there would leave the other ranks waiting until the collective timeout."""
        newest = next(iter(self.iterations()), None)
        if newest is None:
            return None
        try:
            files = json.loads((self.path(newest) / MANIFEST).read_text())["files"]
            size = sum(int(entry["bytes"]) for entry in files.values())
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no manifest to go by (a corrupt newest checkpoint): the write's own failure tells
        free = shutil.disk_usage(self.dir).free
        if free >= size:
            return None
        return (f"{self.path(iteration)}: not written: {free / 2**20:.1f} MiB free in {self.dir}, the newest "
                f"checkpoint ({self.path(newest).name}) took {size / 2**20:.1f} MiB; the earlier checkpoints are "
                "untouched (free space there, or lower trainer.keep_checkpoints)")

    def finish(self, iteration: int, publication: Publication) -> Path:
        """Collective: publish checkpoint `iteration`, started by `start`, its files written; then prune (`_prune`)."""
        final = publication.complete({"iteration": iteration})
        if rank() == 0:
            self._prune(iteration)
        barrier()
        return final

    def resumable(self) -> list[int]:
        """The iterations a resume may use, newest first: the `keep` newest (a `keep_every` one older than them is
        for evaluation; the stream's batches behind the oldest resumable one are pruned)."""
        return self.iterations()[:self.keep]

    def _prune(self, saved: int) -> None:
        """Keep `saved` and the `keep - 1` newest before it, and every multiple of `keep_every`; delete the other
        older ones; set newer ones aside."""
        iterations = self.iterations()
        for iteration in iterations:
            if iteration > saved:
                self.set_aside(iteration, f"newer than iter_{saved:07d}, which the run saved after resuming from an "
                                          f"earlier checkpoint: left by a timeline the run abandoned")
        for iteration in [i for i in iterations if i <= saved][self.keep:]:
            if self.keep_every is None or iteration % self.keep_every:
                shutil.rmtree(self.path(iteration), ignore_errors=True)

    def set_aside(self, iteration: int, reason: str) -> Path:
        """Move checkpoint `iteration` to `unusable/` with a file saying why (never loaded or pruned there)."""
        target = self.dir / UNUSABLE_DIR / self.path(iteration).name
        n = 0
        while target.exists():
            n += 1
            target = target.with_name(f"{self.path(iteration).name}.{n}")
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_durably(self.path(iteration), target)
        atomic_write_text(target / UNUSABLE_REASON, f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {reason}\n")
        log.warning("set aside %s as %s: %s", self.path(iteration).name, target, reason)
        return target

    # -- reading ----------------------------------------------------------------------------------------------

    @staticmethod
    def problems(path: Path, *, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> list[str]:
        """Why `path` is not a complete checkpoint (empty list: it is). `share` = (i, n) checks only every n-th
        file starting at the i-th (ranks split the hashing; see `latest_valid`)."""
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            return ["no manifest.json: an unfinished save, or not a checkpoint"]
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            return [f"manifest.json unreadable: {exc}"]
        out = []
        index, count = share
        for rel, entry in sorted(files.items())[index::count]:
            file = path / rel
            if not file.is_file():
                out.append(f"{rel}: missing")
            elif file.stat().st_size != entry["bytes"]:
                out.append(f"{rel}: {file.stat().st_size} bytes, manifest says {entry['bytes']}")
            elif checksums and sha256_file(file) != entry["sha256"]:
                out.append(f"{rel}: sha256 mismatch")
        return out

    def latest_valid(self, *, checksums: bool = True, set_aside: bool = False) -> tuple[int, Path] | None:
        """Newest checkpoint that passes its manifest, or None when there is no checkpoint at all.

        Collective when a process group exists: the ranks split the hashing and all reach the same answer.
        Skipped checkpoints are logged with their reason, and with `set_aside` (the trainer resuming) moved to
        `unusable/` by rank 0, so later saves and prunes never see them. Raises CheckpointError if checkpoints exist
        but none is valid (resuming from scratch silently would lose the run); then nothing is moved.
        """
        skipped = []
        for iteration in from_rank0(self.iterations() if rank() == 0 else None):
            path = self.path(iteration)
            found = checkpoint_problems(path, checksums=checksums, collective=True)
            if not found:
                for skipped_iteration, reasons in skipped:
                    log.warning("skipping corrupt checkpoint %s (%s); using %s", self.path(skipped_iteration).name,
                                reasons, path.name)
                    if set_aside and rank() == 0:
                        self.set_aside(skipped_iteration, f"failed validation ({reasons}); resumed from {path.name}")
                if set_aside:
                    barrier()
                return iteration, path
            skipped.append((iteration, "; ".join(found[:3])))
        if skipped:
            detail = ", ".join(f"{self.path(i).name}: {reasons}" for i, reasons in skipped)
            raise CheckpointError(f"{self.dir}: no valid checkpoint ({detail})")
        return None


def read_rl_state(path: Path) -> dict:
    """The RL state (`rl_state.json`) of checkpoint directory `path`."""
    try:
        return json.loads((path / RL_STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / RL_STATE}: unreadable: {exc}") from None
