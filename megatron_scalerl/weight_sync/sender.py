"""The trainer-side driver: push the trainer's weights to N vLLM servers at once over vLLM's weight-transfer protocol.

    config = WeightSyncConfig(bucket_mib=256, serving_dtype=torch.bfloat16, timeout_s=120)
    sender = WeightSender(["http://gen0:8000", "http://gen1:8000"], config).connect() if rank == 0 else None
    push_weights(trainer.model, recipe.model, config, sender, weight_version=state.step)  # every rank

One broadcast group holds trainer rank 0 (group rank 0, hosting the rendezvous) and every server's workers: server i
at rank offset 1 + the worker counts of the servers before it (`protocol.rank_offsets`; each server reports its
count on `/get_world_size`). The transport is the machine's process-group backend (`platform.resolve_backend`):
vLLM's own NCCL engine on GPUs, our gloo engine (`gloo_engine`) on CPUs. A sync, on every server concurrently:
`/start_weight_update`; per bucket `/update_weights` (names, dtype names, shapes) while rank 0 broadcasts the
bucket; `/finish_weight_update` with the policy version (`algo.versions.version_tag`); `/reset_prefix_cache`
(running requests are re-queued, so no KV block computed with the old weights is reused). With `pause_generation`
(the default) the sync is wrapped in `/pause?mode=keep` ... `/resume`, the one place that pauses the servers:
running requests freeze in place and continue on the new weights (PipelineRL's in-flight update); a failed sync
leaves the servers paused, so nothing is generated from half-updated weights. Every HTTP call and broadcast waits at
most `timeout_s` seconds; a failure raises WeightSyncError naming the server (and whether it still answers /health) and
the bucket. After a failure the sender must be closed; the servers need a complete sync before serving again.

Checksum mode (`checksums=True`): the receivers record a checksum of every tensor they received and the sender
compares them (`/collective_rpc` `scalerl_weight_checksums`, one answer per worker) with its own after the sync:
a mismatch names the server, worker, bucket and tensor. Needs a receiver that records them (the gloo engine).
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from megatron_scalerl.algo.versions import version_tag
from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.platform.distributed import from_rank0, resolve_backend
from megatron_scalerl.recipe import ModelConfig
from megatron_scalerl.weight_sync.export import export_buckets
from megatron_scalerl.weight_sync.protocol import (
    MIB,
    Bucket,
    WeightSyncError,
    checksum,
    local_address_towards,
    rank_offsets,
)
from megatron_scalerl.weight_sync.transport import make_transport

log = logging.getLogger("megatron_scalerl.weight_sync")


@dataclass(frozen=True)
class WeightSyncConfig:
    """`bucket_mib`: bucket size (MiB); `serving_dtype`: the servers' dtype (the LM head stays FP32 with
    `fp32_lm_head`); `timeout_s`: bound (seconds) on each HTTP call, broadcast and the rendezvous; `checksums`:
    verify every tensor's checksum on every server worker after each sync; `api_key`: the servers' key;
    `pause_generation`: freeze the servers' running requests during the update (pause(keep) -> update -> resume)."""

    bucket_mib: float = 256.0
    serving_dtype: torch.dtype = torch.bfloat16
    fp32_lm_head: bool = True
    timeout_s: float = 120.0
    checksums: bool = False
    api_key: str | None = None
    pause_generation: bool = True


@dataclass(frozen=True)
class SyncStats:
    weight_version: int  # the policy version the servers now serve
    buckets: int
    bytes: int
    seconds: float
    checksums_verified: int  # tensors x server workers compared (0 without checksum mode)


class WeightSender:
    """Trainer rank 0's side of weight sync to the servers at `urls` (base URLs, e.g. "http://gen0:8000")."""

    def __init__(self, urls: list[str], config: WeightSyncConfig, *, master_address: str | None = None):
        if not urls:
            raise ValueError("WeightSender needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.config = config
        self.backend = resolve_backend("auto")
        if config.checksums and self.backend != "gloo":
            raise ValueError(f"checksum mode needs receivers that record checksums (the gloo engine); the "
                             f"{self.backend} receiver is vLLM's own and does not")
        # where the servers reach our rendezvous: this machine's address on the route to the first one
        self.master_address = master_address or local_address_towards(
            urllib.parse.urlsplit(self.urls[0]).hostname or "127.0.0.1")
        self.pool = ThreadPoolExecutor(max_workers=len(urls) + 1, thread_name_prefix="weight-sync")
        self.transport = make_transport(self.backend, bucket_bytes=int(config.bucket_mib * MIB))
        self.world_sizes: list[int] = []
        self.failed: str | None = None

    # ---- HTTP to every server at once -------------------------------------------------------------------------

    def _call(self, url: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        return request_json(url, path, body, timeout_s=self.config.timeout_s, api_key=self.config.api_key, **kwargs)

    def _health(self, url: str) -> str:
        try:
            request_json(url, "/health", method="GET", timeout_s=min(5.0, self.config.timeout_s))
            return "answers /health"
        except ServerError as exc:
            return f"does not answer /health: {exc}"

    def _wait(self, labelled: dict[Future, str], what: str) -> list[Any]:
        """Results of `labelled` futures in order. On the first failure, or after `timeout_s`, raise WeightSyncError
        naming `what`, every failed or silent party (a server URL or the trainer's broadcast) and, for each server,
        whether it still answers /health."""
        done, pending = wait(labelled, timeout=self.config.timeout_s + 5, return_when=FIRST_EXCEPTION)
        failures = [f for f in done if f.exception() is not None]
        if not failures and not pending:
            return [f.result() for f in labelled]
        if failures:  # let the other parties' errors arrive: the broadcast often fails because a server died
            more, pending = wait(pending, timeout=min(5.0, self.config.timeout_s))
            failures += [f for f in more if f.exception() is not None]
        parts = [f"{labelled[f]}: {f.exception()}" for f in failures]
        parts += [f"{labelled[f]}: no answer within {self.config.timeout_s:g} s" for f in pending]
        servers = [label for label in labelled.values() if label in self.urls]
        health = [f"{url} {self._health(url)}" for url in servers]
        self.failed = f"weight sync ({what}) failed: " + "; ".join(parts) + (" [" + "; ".join(health) + "]"
                                                                            if health else "")
        raise WeightSyncError(self.failed)

    def _each(self, what: str, fn: Callable[[str], Any]) -> list[Any]:
        return self._wait({self.pool.submit(fn, url): url for url in self.urls}, what)

    # ---- protocol ---------------------------------------------------------------------------------------------

    def connect(self) -> WeightSender:
        """Form the broadcast group with every server's workers (and make their LM heads FP32 if asked)."""
        answers = self._each("GET /get_world_size", lambda url: self._call(url, "/get_world_size", method="GET"))
        self.world_sizes = [int(a["world_size"]) for a in answers]
        offsets, world = rank_offsets(self.world_sizes)
        if self.config.fp32_lm_head and self.config.serving_dtype != torch.float32:
            self._each("FP32 LM head", lambda url: self._call(url, "/collective_rpc",
                                                              {"method": "scalerl_fp32_lm_head"}))
        rendezvous = self.transport.listen(self.master_address)  # a new one (port, secret) per connection
        init = {url: self.transport.worker_init_info(offset, world, self.config)
                for url, offset in zip(self.urls, offsets, strict=True)}
        futures = {self.pool.submit(self._call, url, "/init_weight_transfer_engine", {"init_info": init[url]}): url
                   for url in self.urls}
        futures[self.pool.submit(self.transport.open, world, self.config.timeout_s)] = (
            f"trainer rendezvous at {rendezvous} ({world} ranks)")
        self._wait(futures, "connect")
        return self

    def send(self, buckets: Iterable[Bucket], weight_version: int,
             progress: Callable[[Bucket], None] | None = None) -> SyncStats:
        """One full update of every server from `buckets` (the whole model), tagged policy version `weight_version`;
        `progress(bucket)` is called after each bucket reached every server."""
        if self.failed is not None:
            raise WeightSyncError(f"weight sender unusable after an earlier failure: {self.failed}")
        if not self.world_sizes:
            raise WeightSyncError("weight sender not connected: call connect() first")
        try:
            return self._send(buckets, weight_version, progress)
        except WeightSyncError as exc:  # e.g. the export failed: the servers are left inside an update
            self.failed = self.failed or str(exc)
            raise

    def _send(self, buckets: Iterable[Bucket], version: int, progress: Callable[[Bucket], None] | None) -> SyncStats:
        start = time.monotonic()
        if self.config.pause_generation:
            self._each("POST /pause", lambda url: self._call(url, "/pause", query={"mode": "keep",
                                                                                  "clear_cache": False}))
        self._each("POST /start_weight_update", lambda url: self._call(url, "/start_weight_update"))
        sent: dict[str, tuple[str, int]] = {}  # name -> (checksum, bucket index)
        count = total = 0
        for bucket in buckets:
            info = {**bucket.update_info(), **self.transport.update_extras(bucket)}
            futures = {self.pool.submit(self._call, url, "/update_weights", {"update_info": info}): url
                       for url in self.urls}
            futures[self.pool.submit(self.transport.broadcast, bucket, self.config.timeout_s)] = "trainer broadcast"
            self._wait(futures, bucket.describe())
            if self.config.checksums:
                sent.update((name, (checksum(t), bucket.index)) for name, t in bucket.tensors())
            count, total = count + 1, total + bucket.nbytes
            if progress is not None:
                progress(bucket)
            del bucket, futures  # let the next bucket be exported without this one alive
        self._each("POST /finish_weight_update",
                   lambda url: self._call(url, "/finish_weight_update", {"weight_version": version_tag(version)}))
        self._each("POST /reset_prefix_cache", self._reset_prefix_cache)
        if self.config.pause_generation:
            self._each("POST /resume", lambda url: self._call(url, "/resume"))
        verified = self._verify_checksums(sent) if self.config.checksums else 0
        return SyncStats(version, count, total, time.monotonic() - start, verified)

    def _reset_prefix_cache(self, url: str) -> None:
        answer = self._call(url, "/reset_prefix_cache", query={"reset_running_requests": True})
        if not (answer or {}).get("success", False):
            raise WeightSyncError(f"{url}: /reset_prefix_cache did not succeed ({answer})")

    def _verify_checksums(self, sent: dict[str, tuple[str, int]]) -> int:
        answers = self._each("checksums", lambda url: self._call(url, "/collective_rpc",
                                                                 {"method": "scalerl_weight_checksums"}))
        problems, verified = [], 0
        for url, answer in zip(self.urls, answers, strict=True):
            for worker, received in enumerate(answer["results"]):
                if received is None:
                    raise WeightSyncError(f"{url} worker {worker}: its receiver records no checksums (checksum mode "
                                          f"needs the gloo receiver, initialised with checksums on)")
                for name, (expected, bucket) in sent.items():
                    got = received.get(name)
                    if got != expected:
                        problems.append(f"{url} worker {worker} bucket {bucket} {name}: trainer {expected}, "
                                        f"server {got or 'nothing received'}")
                    verified += 1
        if problems:
            raise WeightSyncError(f"weight sync checksum mismatch ({len(problems)}): " + "; ".join(problems[:10]))
        return verified

    def close(self) -> None:
        """Release the servers' ends (`/shutdown_weight_transfer_engine`; a server still inside a failed update
        refuses and keeps its group until its receive times out), leave the group, stop the HTTP threads."""
        if self.world_sizes:
            for url in self.urls:
                try:
                    request_json(url, "/shutdown_weight_transfer_engine", timeout_s=min(10.0, self.config.timeout_s),
                                 api_key=self.config.api_key)
                except ServerError as exc:
                    log.warning("weight sync: could not release %s: %s", url, exc)
            self.world_sizes = []
        self.transport.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def push_weights(model_chunks: list, model_cfg: ModelConfig, config: WeightSyncConfig, sender: WeightSender | None,
                 weight_version: int, progress: Callable[[Bucket], None] | None = None) -> SyncStats | None:
    """Collective over every trainer rank: export the model (`export.export_buckets`) and, on rank 0 (the only rank
    with a `sender`), send it. Rank 0's failure reaches every rank as the same WeightSyncError after the export is
    drained, so no rank is left waiting in a collective. Returns the stats on rank 0, None elsewhere; `progress`:
    see `WeightSender.send`."""
    buckets = export_buckets(model_chunks, model_cfg, bucket_mib=config.bucket_mib,
                             serving_dtype=config.serving_dtype, fp32_lm_head=config.fp32_lm_head)
    stats, error, failure = None, None, None
    if sender is not None:
        try:
            stats = sender.send(buckets, weight_version, progress)
        except WeightSyncError as exc:
            error, failure = str(exc), exc
        except Exception as exc:  # whatever it is, the other ranks must hear of it rather than wait
            error, failure = f"weight sync failed on trainer rank 0: {type(exc).__name__}: {exc}", exc
    for _ in buckets:  # the rest of the export (other ranks' collectives), after a failure or on ranks without one
        pass
    error = from_rank0(error)
    if error is not None:
        raise WeightSyncError(error) from failure
    return stats
