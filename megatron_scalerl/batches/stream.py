"""The rollout stream: how TrainBatches travel from the orchestrator (the writer) to the trainer (the reader).

Each side programs against its interface, `BatchWriter` or `BatchReader`; `RolloutStream` is the one transport
today, a folder `RUN/rollouts/` of files `batch_NNNNNNNN.safetensors` (`train_batch.encode`) written atomically by
the orchestrator and read in order by the trainer. The trainer's checkpoint records the index of the next batch to
read, so a resumed run continues exactly where it stopped. A batch index is never written twice; batches sampled
past a resumed checkpoint are moved aside, not rewritten (`orchestrator/state.py`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from megatron_scalerl.batches.train_batch import BatchError, TrainBatch, decode, encode
from megatron_scalerl.fileio import atomic_write_bytes


class BatchWriter(Protocol):
    """The producer's side (the orchestrator)."""

    def next_index(self) -> int:
        """The index the next `put` writes."""

    def put(self, batch: TrainBatch, metadata: dict | None = None, *, index: int | None = None) -> int:
        """Append `batch` as the next index (a given `index` must be that one); returns the index."""


class BatchReader(Protocol):
    """The consumer's side (the trainer; rank 0 polls, every rank reads)."""

    def ready(self, index: int) -> bool:
        """Whether batch `index` can be read now."""

    def read(self, index: int, vocab_size: int | None = None) -> tuple[TrainBatch, dict]:
        """Batch `index`, validated, and its metadata."""

    def missing(self, index: int, waited_s: float) -> TimeoutError:
        """The error of a reader that waited `waited_s` seconds for batch `index` in vain."""

    def prune(self, *, before: int) -> int:
        """Drop the batches below `before` (trained on, behind every kept checkpoint); returns how many."""


class RolloutStream:
    """`RUN/rollouts/batch_NNNNNNNN.safetensors`, written in order by one producer and read by the trainer: a
    `BatchWriter` and a `BatchReader`.

    Index i is the i-th TrainBatch the orchestrator produced (0-based); the trainer reads index i for its step i.
    """

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir) / "rollouts"

    def path(self, index: int) -> Path:
        return self.dir / f"batch_{index:08d}.safetensors"

    def next_index(self) -> int:
        """The index the producer writes next (one past the highest written; pruning keeps the newest)."""
        indices = [int(p.stem.split("_")[1]) for p in self.dir.glob("batch_*.safetensors")]
        return max(indices, default=-1) + 1

    def put(self, batch: TrainBatch, metadata: dict | None = None, *, index: int | None = None) -> int:
        """Validate and append a batch atomically as `index` (default: the next one; a given index must be the
        next one, so a batch is never written twice); returns its index."""
        batch.validate("TrainBatch to write")
        expected = self.next_index()
        if index is not None and index != expected:
            raise BatchError(f"{self.dir}: TrainBatch {index} to write, but the stream's next index is {expected}")
        index = expected
        atomic_write_bytes(self.path(index), encode(batch, {"index": index, "created": time.time(), **(metadata or {})}))
        return index

    def prune(self, *, before: int) -> int:
        """Delete the batches with index < `before` (already trained on and behind every kept checkpoint), except
        the newest, which marks where the producer continues (`next_index`)."""
        removed = 0
        before = min(before, self.next_index() - 1)
        for path in self.dir.glob("batch_*.safetensors"):
            if int(path.stem.split("_")[1]) < before:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def ready(self, index: int) -> bool:
        """Whether batch `index` is in the stream (it appears whole: written atomically)."""
        return self.path(index).exists()

    def read(self, index: int, vocab_size: int | None = None) -> tuple[TrainBatch, dict]:
        """Batch `index` (it must be `ready`), validated, and its metadata."""
        path = self.path(index)
        batch, meta = decode(path)
        return batch.validate(str(path), vocab_size), meta

    def missing(self, index: int, waited_s: float) -> TimeoutError:
        """The error of a consumer that waited `waited_s` seconds for batch `index` in vain."""
        return TimeoutError(f"no TrainBatch {index} in {self.dir} after {waited_s:.0f} s: is the orchestrator (the "
                            "stream's producer) running?")
