"""The two off-policy modes as one definition (paper section 2.1): how stale a trained token may be, and after which
optimizer steps the generators get new weights. The orchestrator's admission control and the trainer's weight push
both read it, so the two halves of a mode cannot disagree.

- PipelineRL-k (`pipeline`): the trainer sends its weights after every step; generation never waits, and a token may
  be up to k steps behind the step that trains it.
- PPO-off-policy-k (`ppo`): the trainer sends its weights after every k-th step; one frozen policy generates a block of
  k batches, so a token is at most k - 1 steps behind.
"""

from __future__ import annotations

MODES = ("pipeline", "ppo")


def _check(mode: str, k: int) -> None:
    if mode not in MODES or k < 1:
        raise ValueError(f"off-policy mode {mode!r} with k={k}: expected one of {MODES} and k >= 1")


def staleness_bound(mode: str, k: int) -> int:
    """The most optimizer steps a trained token may be behind the step that trains it."""
    _check(mode, k)
    return k if mode == "pipeline" else k - 1


def pushes_weights_after(mode: str, k: int, step: int, last_step: int | None = None) -> bool:
    """Whether the trainer's weights after `step` optimizer steps go to the generators: the schedule's steps, and
    the run's `last_step` whatever the schedule (the orchestrator validates it; under PPO-off-policy-k a last step
    off the k-th step schedule would otherwise never reach the generators)."""
    _check(mode, k)
    return mode == "pipeline" or step % k == 0 or step == last_step


def last_push_step(mode: str, k: int, step: int) -> int:
    """The latest step <= `step` whose weights the schedule sends (0 counts: the trainer's first push). A generator
    serving any version from it to `step` is current (after a restart it gets `step`'s weights themselves)."""
    _check(mode, k)
    return step if mode == "pipeline" else step - step % k


def next_push_step(mode: str, k: int, step: int, last_step: int) -> int:
    """The earliest step >= `step` whose weights the schedule sends, at most `last_step` (always sent): the first
    version the generators serve from `step` on."""
    _check(mode, k)
    return min(step if mode == "pipeline" else step + (-step) % k, last_step)
