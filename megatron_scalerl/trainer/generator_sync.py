"""The trainer's link to the generator fleet: its weights go to the generators at its start and after each step.

    link = GeneratorLink.from_run_dir(run_dir, recipe, is_rank0=rank == 0)    # None when the run has no generators
    link.first_push(trainer.model, version=state.step, timeout_s=3600,  # collective: once a generator answers
                    stopping=lambda: False)                             # (or not at all once stopping() on rank 0)
    link.push(trainer.model, version=state.step)      # collective: every trainer rank calls it
    link.catch_up(trainer.model, version=state.step)  # collective: re-sync a generator that restarted

The generators are listed in `RUN/generators.json` (`{"urls": [...], "dtype": "float32"}`, written by the launcher;
`dtype` is the servers' serving dtype, the API key comes from `$SCALERL_API_KEY`). A push after step s is tagged
version s, the policy after s optimizer steps: the tokens it generates carry s in the rollout stream, so staleness is
counted in optimizer steps.

Rank 0 talks to the servers and tells the other ranks what to do (`from_rank0`), so every rank takes the same path
through the collective export:
- `first_push`: at the trainer's start (the launcher starts it beside the generators), wait until a generator
  answers, then `push`: no step is trained before the fleet serves the trainer's weights.
- `push`: the servers that answer (/weight_info) get the weights in flight (`WeightSender`: every sending rank its
  own slices, received while the servers generate where they have the room, paused only to load them; the load of
  such a staged sync runs in the background while the trainer trains on, `WeightSyncConfig.overlap_apply`, and
  whatever asks the servers next waits for it first). When the
  set of live servers changed, the senders' groups are formed again. The recipe's `weight_sync` section sets the
  transport, bucket size, staging and checksum interval. A sync that fails (a server
  died during it) is retried once without the servers that stopped answering; a second failure raises.
- `catch_up`: a live server whose weight version is not the trainer's (it came up after the first push, it
  restarted and serves its start-up weights, or it was down during a push) gets a push. The trainer calls it while it
  waits for its next batch, so a generator is serving the current policy before the orchestrator gives it work.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_scalerl.algo.off_policy import last_push_step
from megatron_scalerl.algo.versions import NO_VERSION, parse_version
from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.models.weights import sends_weights
from megatron_scalerl.platform.distributed import from_rank0
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.run.directory import API_KEY_ENV, read_generators
from megatron_scalerl.weight_sync.protocol import WeightSyncError
from megatron_scalerl.weight_sync.sender import SyncStats, WeightSender, WeightSyncConfig, push_weights

log = logging.getLogger("megatron_scalerl.trainer")

HEALTH_TIMEOUT_S = 5.0
WEIGHT_SYNC_DIR = "weight_sync"  # RUN/weight_sync/: the disk transport's files (`weight_sync.transport: disk`)


class GeneratorLink:
    """Trainer side of the run's generators (see the module docstring). Every method is collective."""

    def __init__(self, urls: list[str], recipe: Recipe, config: WeightSyncConfig, *, is_rank0: bool):
        self.urls = urls
        self.model_cfg = recipe.model
        self.off_policy = (recipe.rollout.off_policy, recipe.rollout.k)
        self.config = config
        self.is_rank0 = is_rank0
        self.sender: WeightSender | None = None
        self.sent_version = NO_VERSION  # the version the sender's last push delivered to all its servers
        self.syncs = 0  # syncs attempted by the senders closed so far (`WeightSender.syncs`)

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, recipe: Recipe, *, is_rank0: bool) -> GeneratorLink | None:
        found = read_generators(run_dir)
        if found is None:
            return None
        urls, dtype = found
        section = recipe.weight_sync
        config = WeightSyncConfig(bucket_mib=section.bucket_mib, serving_dtype=getattr(torch, dtype),
                                  fp32_lm_head=recipe.trainer.fp32_lm_head,
                                  timeout_s=float(recipe.cluster.collective_timeout_s),
                                  transport=section.transport, disk_dir=str(Path(run_dir) / WEIGHT_SYNC_DIR),
                                  staging=section.staging, checksum_every=section.checksum_every,
                                  api_key=os.environ.get(API_KEY_ENV), overlap_apply=True)
        return cls(urls, recipe, config, is_rank0=is_rank0)

    # ---- rank 0: what the servers say ----------------------------------------------------------------------------

    def _ask(self, url: str, path: str) -> tuple[bool, dict | None]:
        """(answered, JSON answer) of GET `path` on one server."""
        try:
            return True, request_json(url, path, method="GET", timeout_s=HEALTH_TIMEOUT_S, api_key=self.config.api_key)
        except ServerError:
            return False, None

    def _served(self) -> dict[str, int]:
        """The policy version each server that answers serves (its /weight_info, `algo.versions.parse_version`;
        NO_VERSION for its start-up weights), by URL: one call per server tells both whether it is live and what it
        serves. A load still running in the background is waited for first (a failed one makes the sender unusable:
        the next push connects again)."""
        if self.sender is not None:
            self.sender.settle()
        served = {}
        for url in self.urls:
            answered, info = self._ask(url, "/weight_info")
            if answered:
                served[url] = parse_version((info or {}).get("weight_version"))
        return served

    def _connect(self, live: list[str]) -> str | None:
        """Collective: (re)form the senders' groups with the servers `live`; returns an error message or None."""
        self._close()
        try:
            self.sender = WeightSender(live, self.config, sends=sends_weights(), syncs=self.syncs).connect()
            return None
        except (WeightSyncError, ServerError) as exc:
            self._close()
            return f"connecting to the generators {live}: {exc}"

    def _close(self) -> None:
        if self.sender is not None:
            self.syncs = self.sender.syncs  # the checksum cadence goes on across reconnects
            self.sender.close()
            self.sender = None

    # ---- collective -------------------------------------------------------------------------------------------

    def _prepare(self) -> tuple[list[str], bool]:
        """Rank 0: the live servers, and whether the groups must be formed again: the live set changed, the last
        sync failed, or a server `restarted` (it no longer serves the version the groups last delivered, perhaps
        after a restart between two pushes: its receiver is new)."""
        served = self._served()
        restarted = any(version != self.sent_version for version in served.values())
        live = list(served)
        current = self.sender is not None and self.sender.urls == live and self.sender.failed is None
        return live, bool(live) and (restarted or not current)

    def first_push(self, model_chunks: list, version: int, *, timeout_s: float, stopping: Callable[[], bool],
                   poll_s: float = 0.5) -> None:
        """Wait until a generator answers, then push `version`; return without a push once `stopping()` (asked on
        rank 0); TimeoutError naming the generators after `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            answered, stop = from_rank0((bool(self._served()), stopping()) if self.is_rank0 else None)
            if stop:
                return
            if answered:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no generator of {self.urls} answered within {timeout_s:.0f} s: are they "
                                   "running? (their logs: RUN/logs/vllm_*.log)")
            time.sleep(poll_s)
        self.push(model_chunks, version)

    def push(self, model_chunks: list, version: int) -> dict[str, float]:
        """Send the weights, tagged `version`, to every live server; returns the sync's metrics."""
        error = None
        for attempt in (1, 2):
            if attempt == 2:
                log.warning("weight sync of version %d failed (%s); trying again with the servers that answer",
                            version, error)
            live, reconnect = from_rank0(self._prepare() if self.is_rank0 else None)
            if not live:
                log.warning("no generator answers: version %d is sent when one is back", version)
                return {"sync/generators": 0.0}
            error = self._connect(live) if reconnect else None
            if error is None:
                try:
                    stats = push_weights(model_chunks, self.model_cfg, self.config, self.sender, version)
                    self.sent_version = version
                    return {"sync/generators": float(len(live)), **(sync_metrics(stats) if stats else {})}
                except WeightSyncError as exc:
                    error = str(exc)
            self._close()
        raise WeightSyncError(f"weight sync of version {version} failed twice: {error}")

    def catch_up(self, model_chunks: list, version: int) -> bool:
        """Push `version` if a live server is not current: it serves its start-up weights, a version newer than the
        trainer's (the trainer resumed from an older checkpoint), or one older than the schedule's last push
        (`algo.off_policy.last_push_step`: under PPO-off-policy-k a server keeps the policy of the last k-th step
        while the trainer steps on). Returns whether a push happened."""
        oldest = last_push_step(*self.off_policy, version)
        behind = from_rank0([url for url, served in self._served().items()
                             if served == NO_VERSION or not oldest <= served <= version]
                            if self.is_rank0 else None)
        if not behind:
            return False
        log.info("generators %s are not at version %d: sending it", behind, version)
        self.push(model_chunks, version)
        return True

    def close(self) -> None:
        self._close()


def sync_metrics(stats: SyncStats) -> dict[str, float]:
    """A sync's metrics: `sync/seconds` (the trainer's time in it: the whole sync, or until the senders sent when
    its load is overlapped), `sync/paused_s` (the generators not generating: overlapped, during the loads of the
    syncs before it that ended since the last one), `sync/bytes` (over every sender; each reaches every generator
    worker), `sync/staged` (1: received while generating), `sync/overlapped` (1: loaded while the trainer trains
    on)."""
    return {"sync/seconds": stats.seconds, "sync/paused_s": stats.paused_s, "sync/bytes": float(stats.bytes),
            "sync/staged": float(stats.staged), "sync/overlapped": float(stats.overlapped)}
