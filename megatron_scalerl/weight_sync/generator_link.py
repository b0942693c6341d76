"""The trainer's link to the generator fleet: its weights go to the generators at its start and after each step.

    link = GeneratorLink.from_run_dir(run_dir, recipe, is_rank0=rank == 0,    # None when the run has no generators
                                      deadline=Deadline.of(recipe.launch))  # the trainer's (run.deadlines)
    link.first_push(trainer.model, version=state.step, timeout_s=1800,  # collective: once a generator answers
                    stopping=lambda: False)                             # (or not at all once stopping() on rank 0)
    link.push(trainer.model, version=state.step)      # collective: every trainer rank calls it
    link.catch_up(trainer.model, version=state.step)  # collective: re-sync a generator that restarted
    link.deliver(trainer.model, version=state.step, stopping=lambda: False)  # collective: the last step's weights

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
  such a staged sync runs in the background while the trainer trains on, `SenderConfig.overlap_apply`, and
  whatever asks the servers next waits for it first). When the
  set of live servers changed, the senders' groups are formed again. The recipe's `weight_sync` section sets the
  transport, bucket size, staging and checksum interval. A sync that fails is retried
  without the servers that stopped answering (a server died during it), or as "Failures" below says.
- `catch_up`: a live server whose weight version is not the trainer's (it came up after the first push, it
  restarted and serves its start-up weights, or it was down during a push) gets a push. The trainer calls it while it
  waits for its next batch, so a generator is serving the current policy before the orchestrator gives it work.
- `deliver`: after the last step, until every live server serves the final weights (the orchestrator validates
  them): the last push's load in the background settled, a server that failed it caught up.

Failures (a server that cannot take the weights, e.g. one whose load answers HTTP 500): a sync's failure is pinned
on the servers whose part failed while they still answer /health (`FleetControl.faults`; a server that died is the
launcher's to start again, and a sync it broke is retried without it). Each such failure counts for the server, in a
row until it takes a sync; its cause is logged once, at the first. At RESTART_AFTER failures in a row (a push's
two tries, or two loads in the background) the trainer stops sending to it and asks the launcher to start it again
(`run_dir.request_generator_restart`); once the launcher has (the request is gone), the server gets the weights as
any restarted one does. A server started again for that which fails RESTART_AFTER syncs in a row before it took one
is asked for once more with `again`: the launcher then ends the run with one line naming it and the cause. A
request no launcher acts on within the deadline (`run.deadlines`; at least `launch.first_wait_min`: a server's
start) raises WeightSyncError with that line. A failure pinned on no server (a sender's) is retried once, as
before; a second raises.
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
from megatron_scalerl.recipe.variants import DiskTransportConfig
from megatron_scalerl.run.deadlines import Deadline, minutes
from megatron_scalerl.run.directory import (
    API_KEY_ENV,
    generator_restart_requests,
    read_generators,
    request_generator_restart,
)
from megatron_scalerl.weight_sync.launch_checks import staging_setting
from megatron_scalerl.weight_sync.protocol import WeightSyncError
from megatron_scalerl.weight_sync.sender import SenderConfig, SyncStats, WeightSender, push_weights

log = logging.getLogger("megatron_scalerl.trainer")

HEALTH_TIMEOUT_S = 5.0
RESTART_AFTER = 2  # syncs in a row a live server fails before the launcher is asked to start it again
WEIGHT_SYNC_DIR = "weight_sync"  # RUN/weight_sync/: the disk transport's files unless it names its `dir`


def weight_sync_config(recipe: Recipe, run_dir: str | Path, dtype: str) -> SenderConfig:
    """The trainer's weight sync into generators serving `dtype` (generators.json's), from the recipe's
    `weight_sync` section: the run's key, the disk transport's folder in `run_dir`, loads overlapped with training."""
    section = recipe.weight_sync
    disk = section.transport if isinstance(section.transport, DiskTransportConfig) else None
    return SenderConfig(bucket_mib=section.bucket_mib, serving_dtype=getattr(torch, dtype),
                        fp32_lm_head=recipe.trainer.fp32_lm_head,
                        timeout_s=float(recipe.cluster.collective_timeout_s),
                        transport=section.transport.type,
                        disk_dir=(disk and disk.dir) or str(Path(run_dir) / WEIGHT_SYNC_DIR),
                        staging=staging_setting(recipe, cuda=torch.cuda.is_available()),
                        checksum_every=section.checksum_every,
                        api_key=os.environ.get(API_KEY_ENV))


class GeneratorLink:
    """Trainer side of the run's generators (see the module docstring). Every method is collective."""

    def __init__(self, urls: list[str], recipe: Recipe, config: SenderConfig, *, is_rank0: bool,
                 run_dir: str | Path | None = None, deadline: Deadline | None = None):
        self.urls = urls
        self.model_cfg = recipe.model
        self.off_policy = (recipe.rollout.off_policy, recipe.rollout.k)
        self.config = config
        self.is_rank0 = is_rank0
        self.run_dir = Path(run_dir) if run_dir is not None else None  # where restart requests go
        self.deadline = deadline or Deadline.of(recipe.launch)  # the trainer's: its recent steps
        self.sender: WeightSender | None = None
        self.sent_version = NO_VERSION  # the version the sender's last push delivered to all its servers
        self.syncs = 0  # syncs attempted by the senders closed so far (`WeightSender.syncs`)
        # rank 0: servers that cannot take the weights (the module docstring, "Failures")
        self.failures: dict[str, int] = {}  # url -> syncs in a row pinned on it
        self.causes: dict[str, str] = {}  # url -> the cause of the first of them (the one logged)
        self.asked: dict[str, tuple[float, str]] = {}  # url -> (when its restart was asked, time.monotonic(); the
        # line saying why): sent nothing until the launcher did
        self.restarted: dict[str, str] = {}  # url -> the cause it was started again for, until it takes a sync
        self.logged: str | None = None  # the last failure pinned on no server, as logged
        self.said_behind: tuple | None = None  # the last "not at version" said
        self.fatal: str | None = None  # the line that ends the run (a server that cannot take the weights, no launcher)
        self._tried: WeightSender | None = None  # the sender of the last attempt (its control's faults)

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, recipe: Recipe, *, is_rank0: bool,
                     deadline: Deadline | None = None) -> GeneratorLink | None:
        found = read_generators(run_dir)
        if found is None:
            return None
        urls, dtype = found
        return cls(urls, recipe, weight_sync_config(recipe, run_dir, dtype), is_rank0=is_rank0, run_dir=run_dir,
                   deadline=deadline)

    # ---- rank 0: what the servers say ----------------------------------------------------------------------------

    def _ask(self, url: str, path: str) -> tuple[bool, dict | None]:
        """(answered, JSON answer) of GET `path` on one server."""
        try:
            return True, request_json(url, path, method="GET", timeout_s=HEALTH_TIMEOUT_S, api_key=self.config.api_key)
        except ServerError:
            return False, None

    def _served(self) -> dict[str, int]:
        """The policy version each server that answers serves (its /weight_info, `algo.versions.parse_version`;
        NO_VERSION for its start-up weights), by URL, leaving out those waiting for the launcher to start them again:
        one call per server tells both whether it is live and what it serves. A load still running in the background
        is waited for first (a failed one counts against its servers, `_failed`, and makes the sender unusable: the
        next push connects again)."""
        if self.sender is not None:
            loading = self.sender.applying is not None
            error = self.sender.settle()
            if error is not None:
                self._failed(error)
            elif loading:
                self._took(self.sender.urls)
        served = {}
        for url in self.urls:
            if url in self.asked:
                continue
            answered, info = self._ask(url, "/weight_info")
            if answered:
                served[url] = parse_version((info or {}).get("weight_version"))
        return served

    def _restart_bound_s(self) -> float:
        """How long a server may take to be started again and take the weights: a server's start is that of a run
        (`launch.first_wait_min`), or the deadline if longer."""
        return max(self.deadline.seconds(), self.deadline.first_s)

    def _awaiting(self) -> str | None:
        """Rank 0: forget the restart requests the launcher acted on (those servers get the weights as any restarted
        one); the one-line error once one waited past `_restart_bound_s` (or `fatal`), else None."""
        if self.fatal or not self.asked:
            return self.fatal
        open_requests = generator_restart_requests(self.run_dir)
        for url, (since, line) in list(self.asked.items()):
            index = self.urls.index(url)
            if index not in open_requests:
                del self.asked[url]
                self.restarted[url] = self.causes.pop(url, "")
                self.failures.pop(url, None)
                log.info("generator %d (%s) was started again: it gets the weights once it answers", index, url)
            elif time.monotonic() - since > self._restart_bound_s():
                return f"{line} (no launcher started it again within {minutes(self._restart_bound_s())})"
        return None

    def _failed(self, error: str) -> tuple[bool, str | None]:
        """Rank 0: a sync failed with `error`. (Whether it was pinned on a live server, the one-line error that ends
        the run or None.) Each server it is pinned on (`FleetControl.faults` of the last sender tried) counts one
        failure in a row, its cause logged at the first (unless it is the one it was started again for); at
        RESTART_AFTER the launcher is asked to start it again
        (`_ask_restart`). A failure pinned on none is logged unless it is the one logged last."""
        control = self._tried.control if self._tried is not None else None
        faults = {url: cause for url, cause in (control.faults if control is not None else {}).items()
                  if url in self.urls and url not in self.asked}
        if control is not None:
            control.faults.clear()
        if not faults:
            if error != self.logged:
                log.warning("%s", error)
                self.logged = error
            return False, None
        fatal = None
        for url, cause in faults.items():
            self.failures[url] = self.failures.get(url, 0) + 1
            cause = " ".join(cause.split())[:600]
            if url not in self.causes:
                if cause != self.restarted.get(url):  # once: not again after a restart for the same cause
                    log.warning("generator %d (%s) failed a weight sync: %s", self.urls.index(url), url, error)
                self.causes[url] = cause
            if self.failures[url] >= RESTART_AFTER:
                fatal = self._ask_restart(url) or fatal
        return True, fatal

    def _ask_restart(self, url: str) -> str | None:
        """Rank 0: ask the launcher to start server `url` again (`again` if it was for that already and has taken no
        sync since); from now on nothing is sent to it until the launcher did. Without a run directory: the error."""
        index, cause, again = self.urls.index(url), self.causes[url], url in self.restarted
        line = f"generator {index} ({url}) cannot take the trainer's weights" + (", even after a restart" if again
                                                                                  else "") + f": {cause}"
        if self.run_dir is None:
            self.fatal = line
            return line
        request_generator_restart(self.run_dir, index, url, cause, again=again)
        self.asked[url] = (time.monotonic(), line)
        if again:
            log.error("%s (%d syncs in a row failed): the launcher ends the run", line, self.failures[url])
        else:
            log.warning("generator %d (%s) failed %d weight syncs in a row (the cause above): the launcher is asked "
                        "to start it again; it gets the weights then", index, url, self.failures[url])
        return None

    def _took(self, urls: list[str]) -> None:
        """Rank 0: servers `urls` took a sync: their failures in a row end."""
        for url in urls:
            self.failures.pop(url, None)
            self.causes.pop(url, None)
            self.restarted.pop(url, None)
        self.logged = None

    def _connect(self, live: list[str]) -> str | None:
        """Collective: (re)form the senders' groups with the servers `live`; returns an error message or None."""
        self._close()
        self._tried = WeightSender(live, self.config, sends=sends_weights(), syncs=self.syncs)
        try:
            self.sender = self._tried.connect()
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

    def _prepare(self) -> tuple[list[str], bool, str | None]:
        """Rank 0: the live servers, whether the groups must be formed again (the live set changed, the last sync
        failed, or a server `restarted`: it no longer serves the version the groups last delivered, perhaps after a
        restart between two pushes: its receiver is new), and the error that ends the run or None."""
        fatal = self._awaiting()
        served = self._served()
        restarted = any(version != self.sent_version for version in served.values())
        live = list(served)
        current = self.sender is not None and self.sender.urls == live and self.sender.failed is None
        return live, bool(live) and (restarted or not current), fatal

    def first_push(self, model_chunks: list, version: int, *, timeout_s: float, stopping: Callable[[], bool],
                   poll_s: float = 0.5) -> None:
        """Wait until a generator answers, then push `version`; return without a push once `stopping()` (asked on
        rank 0); TimeoutError naming the generators after `timeout_s` seconds (rank 0's clock decides for all)."""
        deadline = time.monotonic() + timeout_s
        while True:
            answered, stop, late = from_rank0((bool(self._served()), stopping(), time.monotonic() > deadline)
                                              if self.is_rank0 else None)
            if stop:
                return
            if answered:
                break
            if late:
                raise TimeoutError(f"no generator of {self.urls} answered within {minutes(timeout_s)}: are they "
                                   "running? (their logs: RUN/logs/vllm_*.log)")
            time.sleep(poll_s)
        self.push(model_chunks, version)

    def push(self, model_chunks: list, version: int) -> dict[str, float]:
        """Send the weights, tagged `version`, to every live server; returns the sync's metrics. A failure pinned
        on a server is tried again until that server is left to the launcher (module docstring, "Failures"); one
        pinned on none once; WeightSyncError after the second of those, or with the line that ends the run."""
        unexplained = None
        while True:
            live, reconnect, fatal = from_rank0(self._prepare() if self.is_rank0 else None)
            if fatal:
                raise WeightSyncError(fatal)
            if not live:
                if self.is_rank0:
                    log.warning("no generator takes weights now: version %d is sent when one is back", version)
                return {"sync/generators": 0.0}
            error = self._connect(live) if reconnect else None
            if error is None:
                try:
                    stats = push_weights(model_chunks, self.model_cfg, self.config, self.sender, version)
                    self.sent_version = version
                    if self.is_rank0 and stats is not None and not stats.overlapped:
                        self._took(live)
                    return {"sync/generators": float(len(live)), **(sync_metrics(stats) if stats else {})}
                except WeightSyncError as exc:
                    error = str(exc)
            pinned, fatal = from_rank0(self._failed(error) if self.is_rank0 else None)
            self._close()
            if fatal:
                raise WeightSyncError(fatal)
            if not pinned:
                if unexplained is not None:
                    raise WeightSyncError(f"weight sync of version {version} failed twice: {error}")
                unexplained = error
                if self.is_rank0:
                    log.warning("weight sync of version %d: trying again with the servers that answer", version)

    def _behind(self, version: int, exact: bool) -> tuple[list[str], str | None]:
        """Rank 0: the live servers not current for `version` (`catch_up`), and the error that ends the run."""
        fatal = self._awaiting()
        oldest = version if exact else last_push_step(*self.off_policy, version)
        behind = [url for url, served in self._served().items()
                  if served == NO_VERSION or not oldest <= served <= version]
        return behind, fatal

    def catch_up(self, model_chunks: list, version: int, *, exact: bool = False) -> bool:
        """Push `version` if a live server is not current: it serves its start-up weights, a version newer than the
        trainer's (the trainer resumed from an older checkpoint), or one older than the schedule's last push
        (`algo.off_policy.last_push_step`: under PPO-off-policy-k a server keeps the policy of the last k-th step
        while the trainer steps on; `exact`: anything but `version`). Returns whether a push happened."""
        behind, fatal = from_rank0(self._behind(version, exact) if self.is_rank0 else None)
        if fatal:
            raise WeightSyncError(fatal)
        if not behind:
            return False
        if self.is_rank0 and self.said_behind != (behind, version):
            log.info("generators %s are not at version %d: sending it", behind, version)
            self.said_behind = (behind, version)
        self.push(model_chunks, version)
        return True

    def _delivered(self, version: int, since: float) -> tuple[bool, str | None, str | None]:
        """Rank 0, for `deliver`: (every live server serves `version` and none waits for a restart, the error
        once the deadline passed, the error that ends the run; each None if not)."""
        fatal = self._awaiting()
        served = self._served()
        done = bool(served) and not self.asked and all(v == version for v in served.values())
        bound = self._restart_bound_s() if self.asked or self.restarted else self.deadline.seconds()
        late = None
        if not done and time.monotonic() - since > bound:
            causes = "; ".join(f"{url}: {cause}" for url, cause in {**self.restarted, **self.causes}.items())
            late = (f"the final weights (version {version}) did not reach the generators within {minutes(bound)} "
                    f"(they serve {served or 'nothing: none answers'})" + (f"; {causes}" if causes else ""))
        return done, late, fatal

    def deliver(self, model_chunks: list, version: int, *, stopping: Callable[[], bool], poll_s: float = 0.5) -> None:
        """After the last step (its weights pushed): return once every live server serves `version` (the push's load
        in the background settled; a server that failed it caught up, or started again and re-synced), or once
        `stopping()` (asked on rank 0); WeightSyncError naming what they serve after the deadline (the trainer's
        `Deadline`; while a server is started again, at least `launch.first_wait_min`)."""
        since = time.monotonic()
        while True:
            done, late, fatal, stop = from_rank0((*self._delivered(version, since), stopping())
                                                 if self.is_rank0 else None)
            if fatal or late:
                raise WeightSyncError(fatal or late)
            if done or stop:
                return
            if not self.catch_up(model_chunks, version, exact=True):
                time.sleep(poll_s)

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
