"""Trainer rank 0's control of the generators during weight sync: HTTP to every server at once.

    control = FleetControl(["http://gen0:8000"], timeout_s=120, api_key=key)
    control.world_sizes()                      # each server's worker count (TP x PP x DP)
    control.submit_connect(endpoints, sizes, t)  # every worker joins every sender's group (in the background)
    control.stage(plan)                        # workers receive the sync in the background, still generating
    control.pause(); control.start_update(); control.submit_update({"staged": True}); control.finish_update(v)

and rank 0's part of one sync, around the senders' sending (`sender.WeightSender.send`, its steps 2 and 4):

    update = Update(staged=...); control.begin(plan, update)     # the servers told: staged, or paused and receiving
    control.conclude(update, version, errors, sent_checksums)  # received, checksums compared, loaded, tagged, resumed

Every call goes to all servers concurrently and waits at most `timeout_s` seconds; a failure raises WeightSyncError
naming every server that failed or stayed silent, and whether it still answers /health. `faults` keeps, of the
failures so far, each server whose part failed (or stayed silent) while it still answers /health, with its own error:
a server that cannot take the weights, as opposed to one that died (the trainer's `GeneratorLink` has those started
again).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from megatron_scalerl.algo.versions import version_tag
from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.weight_sync.protocol import WeightSyncError, rank_offsets

log = logging.getLogger("megatron_scalerl.weight_sync")
ANSWERS = "answers /health"


class Laps:
    """Seconds between successive `lap(name)` calls, added into `seconds[name]` (from its creation first)."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds, self.last = seconds, time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now


@dataclass
class Update:
    """Rank 0's record of one sync attempt: `staged`; `paused_s` (the servers paused, s: -start until it ends);
    `receiving` (the servers' unstaged `/update_weights` calls in flight); `verified` (checksums compared);
    `phases` (seconds per part, `sender.PHASES`)."""

    staged: bool
    paused_s: float = 0.0
    receiving: dict = field(default_factory=dict)
    verified: int = 0
    phases: dict[str, float] = field(default_factory=dict)


class FleetControl:
    """The servers at `urls` (base URLs) as one party of a weight sync (see the module docstring)."""

    def __init__(self, urls: list[str], *, timeout_s: float, api_key: str | None) -> None:
        if not urls:
            raise ValueError("weight sync needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.pool = ThreadPoolExecutor(max_workers=2 * len(urls) + 1, thread_name_prefix="weight-sync")
        self.faults: dict[str, str] = {}  # url -> its error, for each server that failed a call but answers /health

    def call(self, url: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        return request_json(url, path, body, timeout_s=self.timeout_s, api_key=self.api_key, **kwargs)

    def _health(self, url: str) -> str:
        try:
            request_json(url, "/health", method="GET", timeout_s=min(5.0, self.timeout_s))
            return ANSWERS
        except ServerError as exc:
            return f"does not answer /health: {exc}"

    def health(self) -> str:
        """Each server's URL and whether it answers /health, for error messages."""
        return "; ".join(f"{url} {self._health(url)}" for url in self.urls)

    def wait(self, labelled: dict[Future, str], what: str) -> list[Any]:
        """Results of `labelled` futures in order. On the first failure, or after `timeout_s`, raise WeightSyncError
        naming `what`, every failed or silent party (a server URL or a trainer sender) and, for each server,
        whether it still answers /health."""
        done, pending = wait(labelled, timeout=self.timeout_s + 5, return_when=FIRST_EXCEPTION)
        failures = [f for f in done if f.exception() is not None]
        if not failures and not pending:
            return [f.result() for f in labelled]
        if failures:  # let the other parties' errors arrive: a broadcast often fails because a server died
            more, pending = wait(pending, timeout=min(5.0, self.timeout_s))
            failures += [f for f in more if f.exception() is not None]
        errors = {f: str(f.exception()) for f in failures} | {f: f"no answer within {self.timeout_s:g} s"
                                                               for f in pending}
        parts = [f"{labelled[f]}: {error}" for f, error in errors.items()]
        health = {url: self._health(url) for url in labelled.values() if url in self.urls}
        for f, error in errors.items():
            if health.get(labelled[f]) == ANSWERS:
                self.faults[labelled[f]] = f"{what}: {error}"
        raise WeightSyncError(f"weight sync ({what}) failed: " + "; ".join(parts)
                              + (" [" + "; ".join(f"{url} {h}" for url, h in health.items()) + "]" if health else ""))

    def submit_each(self, fn: Callable[[str], Any]) -> dict[Future, str]:
        return {self.pool.submit(fn, url): url for url in self.urls}

    def each(self, what: str, fn: Callable[[str], Any]) -> list[Any]:
        return self.wait(self.submit_each(fn), what)

    def rpc(self, what: str, method: str, **kwargs: Any) -> list[list[Any]]:
        """`/collective_rpc` `method` on every server: per server, its workers' results."""
        body = {"method": method, **({"kwargs": kwargs} if kwargs else {})}
        return [answer["results"] for answer in self.each(what, lambda url: self.call(url, "/collective_rpc", body))]

    # ---- the steps of a sync ------------------------------------------------------------------------------------

    def world_sizes(self) -> list[int]:
        answers = self.each("GET /get_world_size", lambda url: self.call(url, "/get_world_size", method="GET"))
        return [int(a["world_size"]) for a in answers]

    def submit_connect(self, endpoints: list[dict], world_sizes: list[int], timeout_s: float) -> dict[Future, str]:
        """Every server's workers join every sender's group (`/init_weight_transfer_engine`), in the background: the
        senders form their groups meanwhile."""
        offsets, world = rank_offsets(world_sizes)
        info = {url: {"endpoints": endpoints, "rank_offset": offset, "world_size": world, "timeout_s": timeout_s}
                for url, offset in zip(self.urls, offsets, strict=True)}
        return self.submit_each(lambda url: self.call(url, "/init_weight_transfer_engine", {"init_info": info[url]}))

    def staging_room(self) -> int:
        """The fewest bytes any worker of any server can stage a sync in (`scalerl_staging_room`)."""
        return min(w["bytes"] for workers in self.rpc("staging room", "scalerl_staging_room") for w in workers)

    def stage(self, plan: dict) -> None:
        self.rpc(f"stage sync {plan['sync']}", "scalerl_stage_weights", plan=json.dumps(plan))

    def discard_staged(self) -> None:
        try:
            self.rpc("discard staged", "scalerl_discard_staged")
        except WeightSyncError as exc:
            log.warning("weight sync: could not discard a staged sync: %s", exc)

    def checksums(self) -> list[list[dict[str, str]]]:
        """Per server, per worker: the slice checksums of the last sync."""
        return self.rpc("checksums", "scalerl_weight_checksums")

    def pause(self) -> None:
        self.each("POST /pause", lambda url: self.call(url, "/pause", query={"mode": "keep", "clear_cache": False}))

    def resume(self) -> None:
        self.each("POST /resume", lambda url: self.call(url, "/resume"))

    def start_update(self) -> None:
        self.each("POST /start_weight_update", lambda url: self.call(url, "/start_weight_update"))

    def submit_update(self, update_info: dict) -> dict[Future, str]:
        return self.submit_each(lambda url: self.call(url, "/update_weights", {"update_info": update_info}))

    def finish_update(self, version: int | None) -> None:
        """Close the update session tagged `version`, then drop every prefix-cache block computed with the old
        weights (running requests are re-queued and recompute their KV). `version` None: close it untagged (its
        weights are about to be sent again)."""
        body = {} if version is None else {"weight_version": version_tag(version)}
        self.each("POST /finish_weight_update", lambda url: self.call(url, "/finish_weight_update", body))
        if version is not None:
            self.each("POST /reset_prefix_cache", self._reset_prefix_cache)

    def close_open_updates(self) -> None:
        """Close the update sessions a previous trainer left open (`scalerl_close_update`)."""
        self.rpc("close open updates", "scalerl_close_update")

    def _reset_prefix_cache(self, url: str) -> None:
        answer = self.call(url, "/reset_prefix_cache", query={"reset_running_requests": True})
        if not (answer or {}).get("success", False):
            raise WeightSyncError(f"{url}: /reset_prefix_cache did not succeed ({answer})")

    def release(self) -> None:
        """`/shutdown_weight_transfer_engine` on every server (one still inside a failed update refuses and keeps its
        groups until its receives time out)."""
        for url in self.urls:
            try:
                request_json(url, "/shutdown_weight_transfer_engine", timeout_s=min(10.0, self.timeout_s),
                             api_key=self.api_key)
            except ServerError as exc:
                log.warning("weight sync: could not release %s: %s", url, exc)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- rank 0's part of one sync (`sender.WeightSender`'s steps 2 and 4) ------------------------------------

    def begin(self, plan: dict, update: Update) -> str | None:
        """Rank 0, before the senders send: hand the servers the plan, staged (they receive in the background) or
        not (paused, inside an update session, receiving and loading as the tensors complete); the error or None."""
        try:
            if update.staged:
                self.stage(plan)
            else:
                self._pause_timed(update)
                self.start_update()
                update.receiving = self.submit_update({"plan": plan})
            return None
        except Exception as exc:  # whatever it is, the other ranks must hear of it rather than wait
            return error_message(exc)

    def conclude(self, update: Update, version: int, errors: list[str], sent: dict[str, str] | None
                 ) -> tuple[str | None, str | None]:
        """Rank 0, after the senders sent (`errors`: theirs; `sent`: their slices' checksums when due): wait for the
        receive, compare checksums, load what was staged, tag `version`, resume. Returns (error, what disagreed)."""
        laps = Laps(update.phases)
        try:
            if errors:
                raise WeightSyncError("; ".join(errors) + f" [{self.health()}]")
            if update.receiving:
                self.wait(update.receiving, "receive")
            laps.lap("receive_s")
            # staged: wait until every worker has it all (its checksums answer then), before pausing anything
            received = self.checksums() if update.staged or sent is not None else None
            resend = None
            if sent is not None:
                resend, update.verified = self._compare(sent, received)
            laps.lap("checksums_s")
            if resend and update.staged:
                self.discard_staged()  # nothing of it was loaded; the servers never paused
                return None, resend
            if resend:  # unstaged: close the session untagged, still paused, and send it all again
                self.finish_update(None)
                update.paused_s += time.monotonic()
                return None, resend
            if update.staged:
                self._pause_timed(update)
                self.start_update()
                self.wait(self.submit_update({"staged": True}), "apply staged")
            laps.lap("apply_s")
            self.finish_update(version)
            self.resume()
            update.paused_s += time.monotonic()
            laps.lap("finish_s")
            return None, None
        except Exception as exc:  # whatever it is, the other ranks must hear of it rather than wait
            if update.staged:
                self.discard_staged()
            return error_message(exc), None

    def _pause_timed(self, update: Update) -> None:
        """`pause`, its start counted into `update.paused_s`."""
        update.paused_s -= time.monotonic()
        self.pause()

    def _compare(self, sent: dict[str, str], received: list[list[dict[str, str]]]) -> tuple[str | None, int]:
        """(a description of the mismatches or None, slices x workers compared); `received`: per server, per worker,
        its slices' checksums."""
        problems, verified = [], 0
        for url, workers in zip(self.urls, received, strict=True):
            for worker, received in enumerate(workers):
                for key, expected in sent.items():
                    got = received.get(key)
                    if got != expected:
                        problems.append(f"{url} worker {worker} {key}: trainer {expected}, server "
                                        f"{got or 'nothing received'}")
                    verified += 1
        if problems:
            log.warning("weight sync checksum mismatch (%d): %s", len(problems), "; ".join(problems[:10]))
            return f"{len(problems)} slices, e.g. {problems[0]}", verified
        return None, verified


def error_message(exc: BaseException) -> str:
    """An error as one line: a WeightSyncError's own message, anything else prefixed by its type."""
    return str(exc) if isinstance(exc, WeightSyncError) else f"{type(exc).__name__}: {exc}"
