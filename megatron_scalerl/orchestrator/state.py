"""The orchestrator's saved state, and where a resumed orchestrator continues.

The state (`SavedState`, in `RUN/curriculum.json`): the prompt sampler's position, the No-Positive-Resampling history,
the policy versions validated and the scheduled validations missed (`validation.py`), the prompts admitted but in no
batch yet, and `batch`, the index of the last batch formed. It is saved before batch b is written, with `batch` = b
(so it may describe a batch that is not on disk yet), after the previous state is copied to `curriculum.prev.json`
(`curriculum.json` itself is replaced atomically, never missing); and in place when a batch comes out empty and at
the run's end. A resume continues from whichever of the
two has `batch` = the stream's last index (`load_state`): no batch index is written twice and no admitted prompt is
forgotten.

Each trainer checkpoint holds a copy of the state as it was when the checkpoint was taken (`rl_state.json`, field
`curriculum`). When that copy was read, the generators had served no policy newer than the checkpoint's step N, so
every batch up to the copy's `batch` B was sampled by policies the checkpoint's timeline holds (B >= N - 1: the
trainer had trained batch N - 1). A batch after B may hold tokens of policies N + 1, ... that the trainer then went
on to make. When the trainer resumes from N while the stream goes on past B (it crashed after the checkpoint, or a
newer checkpoint is corrupt), those policies are gone, and so `rewind_to_checkpoint`, before any role starts (the
launchers) and again when the orchestrator resumes:

- finds the checkpoint the trainer resumes from: the newest complete one (`CheckpointStore.latest_valid`, the
  trainer's rule, with sizes checked but not SHA-256: hashing a large checkpoint here would hold up the start; a
  checkpoint whose sizes match but whose bytes do not makes the two disagree, and the trainer then reads batches of
  the timeline it left, as every resume did before);
- when the stream's last index L is past the copy's B: moves batches B + 1 .. L (newest first, so that an
  interrupted rewind leaves a shorter stream, never a gap) and the saved state files into
  `RUN/rollouts/abandoned/from_batch_<B + 1>/` with a note (moved, never deleted; the live stream still holds each
  index once: the next batch written there is B + 1), and saves the copy as `curriculum.json`;
- with no checkpoint at all, the trainer starts again from its initial weights at step 0: every batch and the saved
  state are moved aside and the orchestrator starts afresh;
- leaves everything as it is when the copy reaches the stream's end (B = L, or B = L + 1: the copy was taken between
  saving the state of batch L + 1 and writing it, and `curriculum.prev.json` is the state after L), when the
  checkpoint has no copy (one from before the copies were made), and, with a warning, when batch B itself was pruned
  (the trainer prunes the batches below its oldest kept checkpoint; without batch B the stream would not know that
  it goes on at B + 1).

A batch the trainer has yet to read (index N or later) that cannot be read back (CorruptBatchError: its checksum or
encoding does not hold; `batches.train_batch.decode`) would stop every resume at the same step. The launchers'
rewind (`metrics=True`: it reads every such batch once, before any role starts) therefore moves
it and every batch after it into `RUN/rollouts/abandoned/from_batch_<C>/` as well (with a note naming the fault),
and saves the state after the stream's old end with `batch` = C - 1: the orchestrator writes batch C again from
new prompts. The prompts of the set-aside batches count as drawn (their epoch goes on without them; no prompt is
drawn twice), and the trainer, which resumes at N <= C, never sees a gap.

The launchers' rewind (`metrics=True`, before any role starts) also makes `RUN/metrics.jsonl` hold each trainer step
and each validation once: the records of work the resume redoes (`lost_record`: trainer steps after the checkpoint's
step N; validations and forecasts of policies after N; the batch rows of batches no longer in the stream; evaluations
of checkpoints after N) move to `RUN/metrics.rewound.jsonl` (`metrics.set_aside`). A resumed orchestrator forgets the
validations of policies after N (and the scheduled ones missed after N), so they are made again for the new policies
of those versions.

The orchestrator's wall-clock hours go on from the most it saved or logged (`metrics.logged_wall_hours`, the set-aside records
included): time spent on an abandoned timeline, or after the last saved state of an orchestrator that was killed,
was spent all the same; the run's GPU-hours never go back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.batches.train_batch import CorruptBatchError
from megatron_scalerl.checkpoint.store import RL_STATE, CheckpointStore, read_rl_state
from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_text, replace_durably
from megatron_scalerl.run.directory import CURRICULUM_FILE, PREVIOUS_CURRICULUM_FILE
from megatron_scalerl.run.metrics_log import REWOUND_FILE, set_aside

ABANDONED_DIR = "abandoned"  # under RUN/rollouts/
ABANDONED_NOTE = "ABANDONED.txt"


@dataclass(frozen=True)
class SavedState:
    """What a resumed orchestrator needs to go on as if it had never stopped."""

    batch: int  # index of the last batch formed (-1: none yet); saved before that batch is written
    next_group: int  # index of the next group to admit
    sampler: dict  # PromptSampler.state_dict()
    resampling: dict  # NoPositiveResampling.state_dict()
    validated: list[int]  # policy versions whose validation is in metrics.jsonl
    pending: list[str]  # prompt keys admitted but in no batch: admitted again first
    wall_hours: float  # the orchestrator's wall-clock hours over its restarts
    missed: list[int] = field(default_factory=list)  # scheduled validations recorded missed (`val/missed`); a state
    # saved before there were any records has none

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def parse(cls, record: Any, source: str) -> SavedState:
        """The state in `record` (a JSON object); UserError naming `source` and the field when it is malformed."""
        try:
            state = cls(batch=int(record["batch"]), next_group=int(record["next_group"]),
                        sampler=dict(record["sampler"]), resampling=dict(record["resampling"]),
                        validated=[int(v) for v in record["validated"]], pending=[str(k) for k in record["pending"]],
                        wall_hours=float(record["wall_hours"]), missed=[int(v) for v in record.get("missed", [])])
        except (KeyError, TypeError, ValueError) as exc:
            expected = ", ".join(f.name for f in fields(cls))
            raise UserError(f"{source}: malformed orchestrator state ({type(exc).__name__}: {exc}); expected "
                            f"{{{expected}}}") from None
        if state.batch < -1:
            raise UserError(f"{source}: malformed orchestrator state: batch {state.batch} (-1 or a batch index)")
        return state


def save_state(run_dir: Path, state: SavedState, *, new_batch: bool) -> None:
    """Write `state` as `RUN/curriculum.json`; before a new batch (`new_batch`) the state it replaces is kept as
    `curriculum.prev.json`, the one a resume needs if the batch never lands."""
    path = run_dir / CURRICULUM_FILE
    if new_batch and path.is_file():
        atomic_write_text(run_dir / PREVIOUS_CURRICULUM_FILE, path.read_text())
    atomic_write_text(path, state.to_json())


def load_state(run_dir: Path, last: int) -> tuple[SavedState, Path] | None:
    """The saved state after batch `last` (the stream's last index; -1: an empty stream) and its file; None when
    neither file holds it and the stream is empty. UserError when the stream has batches but no state matches them
    (going on would repeat or skip prompts), or a state file is malformed."""
    for path in (run_dir / CURRICULUM_FILE, run_dir / PREVIOUS_CURRICULUM_FILE):
        if not path.is_file():
            continue
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: malformed orchestrator state: {exc}") from None
        state = SavedState.parse(record, str(path))
        if state.batch == last:
            return state, path
    if last >= 0:
        raise UserError(f"{run_dir}: the stream's last batch is {last}, but neither {CURRICULUM_FILE} nor "
                        f"{PREVIOUS_CURRICULUM_FILE} is the state after it: cannot resume without repeating prompts")
    return None


def rewind_to_checkpoint(run_dir: Path, say: Callable[[str], object], *, metrics: bool = False) -> int:
    """Make the stream and the saved state those of the checkpoint the trainer resumes from (the module docstring),
    and with `metrics` the run's history too (`lost_record`; only while no role runs: the launchers); `say` gets one
    sentence when something was moved, or could not be. Returns the step the trainer resumes from (0: none)."""
    latest = CheckpointStore(run_dir, keep=1).latest_valid(checksums=False)
    _rewind_stream(run_dir, latest, say)
    step = latest[0] if latest is not None else 0
    if metrics:  # the launchers' rewind reads the batches once; the orchestrator's resume, after it, need not again
        _set_aside_unreadable(run_dir, step, say)
        last_batch = RolloutStream(run_dir).next_index() - 1
        where = latest[1].name if latest is not None else "the run's start"
        moved = set_aside(run_dir, partial(lost_record, step=step, last_batch=last_batch), f"resumed from {where}")
        if moved:
            say(f"{moved} metrics records of work lost since {where} (trainer steps after {step}, validations of "
                f"policies after it, batches after {last_batch}) moved to RUN/{REWOUND_FILE}")
    return step


def lost_record(record: dict, *, step: int, last_batch: int) -> bool:
    """Whether a metrics record belongs to work a resume from checkpoint `step` redoes, the stream then ending at
    batch `last_batch`: a trainer step after `step`; an orchestrator batch row (its `step` is the batches written,
    so batch b's row is at b + 1) or end-of-run row for a batch after `last_batch`; a validation or forecast row of a
    policy after `step`; an evaluation of a checkpoint after `step`."""
    role, at = record.get("role"), int(record.get("step", 0))
    if role == "orchestrator" and ("rollout/policy_version" in record or "run/stop_reason" in record):
        return at > last_batch + 1
    return role in ("trainer", "orchestrator", "eval") and at > step


def _rewind_stream(run_dir: Path, latest: tuple[int, Path] | None, say: Callable[[str], object]) -> None:
    stream = RolloutStream(run_dir)
    last = stream.next_index() - 1
    if latest is None:
        copy, where = None, "the run's start (no checkpoint yet)"
    else:
        record = read_rl_state(latest[1]).get("curriculum")
        if record is None:
            return
        copy, where = SavedState.parse(record, f"{latest[1] / RL_STATE}: curriculum"), latest[1].name
    end = copy.batch if copy is not None else -1
    if last <= end:
        return
    if end >= 0 and not stream.ready(end):
        say(f"warning: the trainer resumes from {where}, whose copy of the orchestrator state ends at batch {end}, but "
            f"batch {end} was pruned: batches {end + 1}..{last}, maybe sampled by policies the trainer no longer has, "
            "stay in the stream")
        return
    batches = f"batch {last} was" if last == end + 1 else f"batches {end + 1}..{last} were"
    _set_aside_from(run_dir, end + 1, copy, f"{batches} written after the orchestrator state of {where} (batch "
                    f"{end}), by policies the trainer no longer has: the run resumes from {where}", say)


def _set_aside_unreadable(run_dir: Path, step: int, say: Callable[[str], object]) -> None:
    """The first batch from `step` on that does not read back (CorruptBatchError), and every batch after it, moved
    aside; the state after the stream's old end saved as that of the batch before it (the module docstring)."""
    stream = RolloutStream(run_dir)
    last = stream.next_index() - 1
    for index in range(step, last + 1):
        try:
            if stream.ready(index):
                stream.read(index)
        except CorruptBatchError as exc:
            _set_aside_from(run_dir, index, _state_before(run_dir, index, last),
                            f"batch {index} cannot be read ({exc}): batches {index}..{last} set aside; the "
                            f"orchestrator writes batch {index} again from new prompts (those of the set-aside "
                            "batches count as drawn)", say)
            return


def _state_before(run_dir: Path, index: int, last: int) -> SavedState:
    """The state to go on from at batch `index`: the newest saved one (after batch `last`), as that of batch
    `index` - 1; or the saved one as it is when it is that already (an earlier set-aside was cut short)."""
    saved = run_dir / CURRICULUM_FILE
    if saved.is_file():
        state = SavedState.parse(json.loads(saved.read_text()), str(saved))
        if state.batch == index - 1:
            return state
    return replace(load_state(run_dir, last)[0], batch=index - 1)


def _set_aside_from(run_dir: Path, first: int, state: SavedState | None, why: str,
                    say: Callable[[str], object]) -> None:
    """Move batches `first`.. and the saved state files into `RUN/rollouts/abandoned/from_batch_<first>/` with a note
    saying `why`; `state` (None: none, the orchestrator starts afresh) becomes the saved state. In an order that a
    cut-short move can be done again from: the state files are copied aside, the new state replaces them, then the
    batches move newest first (a shorter stream, never a gap)."""
    stream = RolloutStream(run_dir)
    folder = _free_folder(stream.dir / ABANDONED_DIR / f"from_batch_{first:08d}")
    folder.mkdir(parents=True)
    atomic_write_text(folder / ABANDONED_NOTE, f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {why}\n")
    for name in (CURRICULUM_FILE, PREVIOUS_CURRICULUM_FILE):
        if (run_dir / name).is_file():
            atomic_write_text(folder / name, (run_dir / name).read_text())
    if state is not None:
        save_state(run_dir, state, new_batch=False)
    else:
        (run_dir / CURRICULUM_FILE).unlink(missing_ok=True)
    (run_dir / PREVIOUS_CURRICULUM_FILE).unlink(missing_ok=True)
    for index in range(stream.next_index() - 1, first - 1, -1):
        if stream.ready(index):
            replace_durably(stream.path(index), folder / stream.path(index).name)  # durable in this order
    say(f"{why}; they and the orchestrator state they followed are in {folder}")


def _free_folder(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ... : the first that does not exist (a stream may be rewound more than once)."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate
