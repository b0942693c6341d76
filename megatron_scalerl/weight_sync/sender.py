"""The trainer side of weight sync: every sending rank sends its own weights; rank 0 drives the servers.

    config = SenderConfig(bucket_mib=64, serving_dtype=torch.bfloat16, timeout_s=120)
    sender = WeightSender(urls, config, sends=weights.sends_weights()).connect()      # every trainer rank
    push_weights(trainer.model, recipe.model, config, sender, weight_version=step)    # every trainer rank

Who sends what: each trainer rank that holds weights no other rank sends (`models.weights.export_hf_slices`: TP
shards from every TP rank of data-parallel rank 0, experts from every EP rank, each pipeline stage its own layers)
sends its slices of HF tensors from its own rank over its own group to every generator worker: no gather, nothing
funnelled through one rank. Rank 0 also drives the servers over HTTP (`fleet_control.FleetControl`). Group g holds
sender g (rank 0 of the group) and every server's workers (`protocol.rank_offsets`); its transport is gloo, NCCL or
disk (`transport.py`: `broadcast.py`, `disk.py`), chosen by `SenderConfig.transport`. Each tensor travels in its wire
dtype (`wire_dtype`). The other end, in every generator worker, is `receiver.ScaleRLWeightTransferEngine`.

One sync (`WeightSender.send`, collective over the trainer's ranks):
  1. every sender groups its slices into buckets; the headers reach rank 0 (`all_gathered`): the plan, every
     bucket of every sender, is one JSON object;
  2. rank 0 hands the plan to every server in one call (`FleetControl.begin`): staged (`scalerl_stage_weights`:
     the workers receive in the background into staging tensors and go on generating) or not (pause(keep),
     `/start_weight_update`, one `/update_weights` with the plan: the workers receive and load as the tensors
     complete);
  3. every sender sends its buckets, concurrently with the others;
  4. rank 0 (`FleetControl.conclude`): staged, waits until every worker has received it all
     (`scalerl_weight_checksums` answers then); checksums when due (every `checksum_every`-th sync: each received
     slice's against its sender's; a mismatch is logged and the whole sync sent again, once); staged: pause(keep),
     `/start_weight_update`, `/update_weights {"staged": true}` (loads only), then for both `/finish_weight_update`
     with the policy version, `/reset_prefix_cache` (running requests recompute their KV), `/resume`.
Running requests freeze at the pause and continue on the new weights (PipelineRL's in-flight update). With
`overlap_apply` (the trainer's own syncs), a staged sync without checksums due returns once the senders sent: rank 0
waits for the receive and loads, tags and resumes the servers (step 4) in the background while the trainer trains
on, and the next `send`, `settle` or `close` waits for that first; a failure there is raised by the next `send` on
every rank. A failed sync leaves a staged server generating on its old weights (the staging is dropped), an
unstaged one paused (nothing is generated from half-updated weights) until a complete sync. `SyncStats.paused_s` is
the time the servers were paused, `seconds` the whole sync (overlapped: the trainer's part, until the senders sent).
"""

from __future__ import annotations

import logging
import secrets
import time
import urllib.parse
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megatron_scalerl.models.mapping import kept_fp32
from megatron_scalerl.models.weights import export_hf_slices
from megatron_scalerl.platform.distributed import all_gathered, from_rank0, resolve_backend
from megatron_scalerl.platform.distributed import rank as trainer_rank
from megatron_scalerl.weight_sync.fleet_control import FleetControl, Laps, Update, error_message
from megatron_scalerl.weight_sync.protocol import (
    EMBEDDING,
    LM_HEAD,
    MIB,
    SYNC_TIMEOUT_S,
    Bucket,
    Piece,
    WeightSyncError,
    bucket_header,
    group_buckets,
    in_background,
    local_address_towards,
)
from megatron_scalerl.weight_sync.transport import WeightTransport, make_transport

log = logging.getLogger("megatron_scalerl.weight_sync")
STAGING_SLACK = 1.25  # staging needs this many times the sync's bytes free on every worker (`staging: auto`)


def head_tensor(tied: bool) -> str:
    """The HF name of the tensor that holds the LM head: the embedding when `tied` (`tie_word_embeddings`)."""
    return EMBEDDING if tied else LM_HEAD


def wire_dtype(name: str, serving_dtype: torch.dtype, fp32_lm_head: bool, *, tied: bool) -> torch.dtype:
    """The dtype an HF tensor travels in: FP32 for the LM head's tensor (`head_tensor(tied)`) with `fp32_lm_head`
    and for the tensors kept FP32 (`models.mapping.kept_fp32`: vLLM holds them FP32), else the serving dtype. The
    servers read it from each bucket's header."""
    if (fp32_lm_head and name == head_tensor(tied)) or kept_fp32(name):
        return torch.float32
    return serving_dtype


@dataclass(frozen=True)
class SenderConfig:
    """`bucket_mib`: bucket size (MiB); `serving_dtype`: the servers' dtype (the LM head stays FP32 with
    `fp32_lm_head`); `timeout_s`: bound (seconds) on each HTTP call, each receive and the rendezvous;
    `transport`: auto (nccl with CUDA, else gloo), gloo, nccl or disk (`disk_dir`: the shared folder the disk
    senders write under); `staging`: auto (on when every worker has the room), on or off; `checksum_every`: compare
    every received slice's checksum with its sender's every N-th sync (0: never); `api_key`: the servers' key;
    `overlap_apply` (the default, what the trainer's syncs do): a staged sync without checksums due returns once the
    senders sent, its load applied in the background (module docstring); False: every sync returns once the servers
    serve it (a bench timing whole updates, a caller that reads the servers right after). The servers are paused
    around every load."""

    bucket_mib: float = 64.0
    serving_dtype: torch.dtype = torch.bfloat16
    fp32_lm_head: bool = True
    timeout_s: float = SYNC_TIMEOUT_S
    transport: str = "auto"
    disk_dir: str | None = None
    staging: str = "auto"
    checksum_every: int = 0
    api_key: str | None = None
    overlap_apply: bool = True

    def resolved_transport(self) -> str:
        return resolve_backend("auto") if self.transport == "auto" else self.transport


@dataclass(frozen=True)
class SyncStats:
    weight_version: int  # the policy version the servers now serve
    buckets: int  # over every sender
    bytes: int  # over every sender (each reaches every server worker)
    seconds: float  # the whole sync, from the plan to the resume (overlapped: until the senders sent)
    paused_s: float  # the servers were paused (not generating), in this sync's load and the overlapped loads
    #                  settled since the last sync's stats (an overlapped sync's own load is counted by the next)
    staged: bool
    checksums_verified: int  # slices x server workers compared (0 when not due)
    overlapped: bool = False  # its load is being applied in the background (`SenderConfig.overlap_apply`)
    phases: dict[str, float] = field(default_factory=dict)  # rank 0's seconds in each part (`PHASES`; over both
    #                  attempts when sent twice; an overlapped sync has none of the parts after `senders_s`)


# The parts of one sync on rank 0, in order: taking the slices from the model (`export_s`), the plan (headers
# gathered, the servers told: `plan_s`), sending its own buckets (`send_s`), waiting for the other senders
# (`senders_s`), then on the servers: the unstaged receive-and-load's end (`receive_s`), every worker's checksums
# (staged: the receive's end) and their comparison (`checksums_s`), the staged load (pause, start, apply:
# `apply_s`), tag and resume (`finish_s`).
PHASES = ("export_s", "plan_s", "send_s", "senders_s", "receive_s", "checksums_s", "apply_s", "finish_s")


class WeightSender:
    """One trainer rank's end of weight sync (every rank has one; see the module docstring). `urls`: the servers
    (read on rank 0); `sends`: this rank sends weights (`models.weights.sends_weights()`)."""

    def __init__(self, urls: list[str], config: SenderConfig, *, sends: bool = True,
                 master_address: str | None = None, syncs: int = 0):
        self.config = config
        self.sends = sends
        self.rank = trainer_rank()
        self.control = (FleetControl(urls, timeout_s=config.timeout_s, api_key=config.api_key) if self.rank == 0
                        else None)
        self.urls = self.control.urls if self.control else list(urls)
        self.master_address = master_address
        self.transport: WeightTransport | None = None
        self.senders: list[int] = []  # trainer ranks that send, in group order
        self.syncs = syncs  # syncs attempted, the checksum cadence's count (carried over reconnects by the caller)
        self.room: int | None = None  # the fewest bytes a worker can stage in (rank 0)
        self.failed: str | None = None
        # rank 0, `overlap_apply`: the last sync's load in the background: (its future, version, Update)
        self.applying: tuple[Future, int, Update] | None = None
        self.applied_paused_s = 0.0  # rank 0: the servers' pause in the loads settled since the last sync
        self._background = (ThreadPoolExecutor(1, thread_name_prefix="weight-load")
                            if self.control is not None and config.overlap_apply else None)

    def _transport(self) -> WeightTransport:
        name = self.config.resolved_transport()
        if name != "disk":
            return make_transport(name)
        if not self.config.disk_dir:
            raise ValueError("weight_sync.transport: disk needs a shared folder (SenderConfig.disk_dir)")
        return make_transport(name, directory=Path(self.config.disk_dir) / f"sender-{self.rank}")

    def agree(self, error: str | None, what: str) -> None:
        """Collective: raise WeightSyncError on every rank if any rank had an `error`."""
        errors = [e for e in all_gathered(error) if e]
        if errors:
            self.failed = self.failed or f"{what}: " + "; ".join(errors)
            raise WeightSyncError(self.failed)

    def connect(self) -> WeightSender:
        """Collective: every sender opens its group, every server worker joins all of them (the LM heads made FP32
        first if asked). On failure everything opened is closed again before the error is raised."""
        try:
            self._connect()
        except WeightSyncError:
            self.close()
            raise
        return self

    def _connect(self) -> None:
        error, endpoint = None, None
        if self.sends:
            try:
                self.transport = self._transport()
                address = self.master_address or local_address_towards(
                    urllib.parse.urlsplit(self.urls[0]).hostname or "127.0.0.1")
                endpoint = self.transport.listen(address)
            except (OSError, RuntimeError, ValueError) as exc:
                error = f"trainer rank {self.rank}: {exc}"
        endpoints = all_gathered(endpoint)
        self.agree(error, "weight sync connect")
        self.senders = [r for r, e in enumerate(endpoints) if e is not None]
        world = None
        if self.control is not None:
            try:
                sizes = self.control.world_sizes()
                if self.config.fp32_lm_head and self.config.serving_dtype != torch.float32:
                    self.control.rpc("FP32 LM head", "scalerl_fp32_lm_head")
                joins = self.control.submit_connect([e for e in endpoints if e], sizes, self.config.timeout_s)
                world = 1 + sum(sizes)
            except Exception as exc:
                error = error_message(exc)
        error, world = from_rank0((error, world))
        self.agree(error if self.rank == 0 else None, "weight sync connect")
        # Each sender forms its group in the background while rank 0 watches the servers join: a server that fails
        # to join (its answer names it and why) ends the wait at once, not the group's timeout later.
        opening = (in_background(lambda: self.transport.open(world, self.config.timeout_s), "scalerl-weights-open")
                   if self.sends else None)
        if self.control is not None:
            try:
                waited = {**joins, **({opening: f"trainer rank 0's group of {world} ranks"} if opening else {})}
                self.control.wait(waited, "connect")
                self.control.close_open_updates()
                if self.config.staging != "off":
                    self.room = self.control.staging_room()
            except Exception as exc:
                error = error_message(exc)
        verdict, mine = from_rank0(error), None  # rank 0's, before the other senders wait on their own groups
        if opening is not None and verdict is None:
            try:  # every server joined every group: each has formed, or fails now
                opening.result(timeout=self.config.timeout_s)
            except (OSError, RuntimeError, TimeoutError) as exc:
                mine = f"trainer rank {self.rank}: forming its group of {world} ranks: {exc}"
        self.agree((verdict or mine) if self.rank == 0 else mine, "weight sync connect")

    # ---- one sync -----------------------------------------------------------------------------------------------

    def send(self, pieces: Iterable, weight_version: int, progress: Callable[[Bucket], None] | None = None, *,
             tied: bool = False) -> SyncStats | None:
        """Collective: one full update of every server, tagged policy version `weight_version`, from every rank's
        `pieces` ((name, whole tensor) pairs or slices with `Piece`'s fields; any dtype: each is cast to its wire
        dtype as its bucket is packed: `wire_dtype`, `tied` for a model whose LM head is its embedding).
        `progress(bucket)` is called on a sender after each of its buckets left. Returns the stats on rank 0 (over
        both attempts when checksums disagreed once), None elsewhere."""
        if self.config.overlap_apply:  # the same on every rank: the collective runs on all or none
            self.agree(self.settle(), "weight sync (the last one's load, in the background)")
        if self.failed is not None:
            raise WeightSyncError(f"weight sender unusable after an earlier failure: {self.failed}")
        if not self.senders:
            raise WeightSyncError("weight sender not connected: call connect() first")
        phases: dict[str, float] = {}  # both attempts' parts, added up
        laps = Laps(phases)
        pieces = [Piece.of(p) for p in pieces] if self.sends else []
        laps.lap("export_s")
        config = self.config

        def dtype_of(name: str) -> torch.dtype:
            return wire_dtype(name, config.serving_dtype, config.fp32_lm_head, tied=tied)

        first = None
        for attempt in (1, 2):
            stats, resend = self._sync(pieces, weight_version, dtype_of, progress, phases)
            if not resend:
                return stats if first is None or stats is None else replace(
                    stats, seconds=first.seconds + stats.seconds, paused_s=first.paused_s + stats.paused_s)
            first = stats
            if attempt == 1:
                log.warning("weight sync of version %d: checksums disagree (%s); sending it all again",
                            weight_version, resend)
        self.failed = f"weight sync of version {weight_version}: checksums disagree twice: {resend}"
        raise WeightSyncError(self.failed)

    def _sync(self, pieces: list[Piece], version: int, dtype_of: Callable[[str], torch.dtype],
              progress: Callable[[Bucket], None] | None, phases: dict[str, float]
              ) -> tuple[SyncStats | None, str | None]:
        """One attempt (collective): the stats on rank 0 and, when checksums disagreed, what disagreed; its parts'
        seconds are added into `phases` (the stats hold the sums so far)."""
        start = time.monotonic()
        laps = Laps(phases)
        self.syncs += 1
        check = self.config.checksum_every > 0 and self.syncs % self.config.checksum_every == 0
        groups = group_buckets(pieces, max(1, int(self.config.bucket_mib * MIB)), dtype_of)
        every = all_gathered([bucket_header(i, g, dtype_of) for i, g in enumerate(groups)] if self.sends else None)
        plan = {"sync": f"v{version}-{secrets.token_hex(4)}", "checksums": check,
                "senders": [every[r] for r in self.senders]}
        total = sum(h["nbytes"] for headers in plan["senders"] for h in headers)
        update, error = None, None
        if self.control is not None:
            update = Update(staged=self._staged(total))
            error = self.control.begin(plan, update)
        plan["sync"], error = from_rank0((plan["sync"], error))
        self.agree(error if self.rank == 0 else None, f"weight sync of version {version}")
        laps.lap("plan_s")
        sums: dict[str, str] = {}
        if self.sends:
            error = self._send_buckets(groups, dtype_of, plan["sync"], check, sums, progress)
        laps.lap("send_s")
        every_sum = all_gathered(sums if check else None)
        errors = [e for e in all_gathered(error) if e]
        laps.lap("senders_s")
        resend = None
        if self.control is not None:
            sent = {key: value for part in every_sum if part for key, value in part.items()}
            if self.config.overlap_apply and update.staged and not check and not errors:
                # the receive, load, tag and resume go on while the trainer trains (`settle` waits for them)
                self.applying = (self._background.submit(self.control.conclude, update, version, [], None), version, update)
            else:
                error, resend = self.control.conclude(update, version, errors, sent if check else None)
        error, resend = from_rank0((error, resend))
        self.agree(error if self.rank == 0 else None, f"weight sync of version {version}")
        if update is None:
            return None, resend
        overlapped = self.applying is not None
        paused_s = self.applied_paused_s + (0.0 if overlapped else update.paused_s)
        self.applied_paused_s = 0.0
        if not overlapped:
            for name, seconds in update.phases.items():
                phases[name] = phases.get(name, 0.0) + seconds
        return SyncStats(version, sum(len(s) for s in plan["senders"]), total, time.monotonic() - start,
                         paused_s, update.staged, update.verified, overlapped, dict(phases)), resend

    def settle(self) -> str | None:
        """Rank 0 (elsewhere None at once): wait for the last sync's load in the background, if any; its error, else
        None. After a failed load the sender is unusable (`failed`): its servers dropped the staging and serve the
        version before."""
        if self.applying is None:
            return None
        future, version, update = self.applying
        self.applying = None
        error, _ = future.result()
        self.applied_paused_s += update.paused_s
        if error is not None:
            self.failed = self.failed or f"weight sync of version {version} (its load, in the background): {error}"
            return self.failed
        return None

    def _staged(self, total_bytes: int) -> bool:
        """Whether this sync is staged: `staging` on, or auto and every worker has the room for it."""
        if self.config.staging == "auto":
            return self.room is not None and self.room >= STAGING_SLACK * total_bytes
        return self.config.staging == "on"

    def _send_buckets(self, groups: list[list[Piece]], dtype_of: Callable[[str], torch.dtype], sync: str,
                      check: bool, sums: dict[str, str], progress: Callable[[Bucket], None] | None) -> str | None:
        """Pack and send this rank's buckets one at a time; the error message, or None."""
        bucket = None
        try:
            for index, group in enumerate(groups):
                bucket = Bucket.pack(index, [p.cast(dtype_of(p.name)) for p in group])
                if check:
                    sums.update(bucket.checksums())
                self.transport.send(bucket, sync)
                if progress is not None:
                    progress(bucket)
                del bucket  # one bucket alive at a time
                bucket = None
            return None
        except Exception as exc:
            what = bucket.describe() if bucket is not None else "its buckets"
            return f"trainer rank {self.rank} sending {what}: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        """Wait for a load in the background, release the servers' ends, leave the groups, stop the HTTP threads."""
        if self.control is not None:
            error = self.settle()
            if error is not None:
                log.warning("%s", error)
            if self._background is not None:
                self._background.shutdown()
            if self.senders:
                self.control.release()
            self.control.close()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.senders = []


def push_weights(model_chunks: list, model_cfg, config: SenderConfig, sender: WeightSender,
                 weight_version: int, progress: Callable[[Bucket], None] | None = None) -> SyncStats | None:
    """Collective over every trainer rank: send this rank's slices of the model (`export_hf_slices`) with
    `sender.send`. Returns the stats on rank 0, None elsewhere."""
    if len(model_chunks) != 1:
        raise ValueError(f"weight sync supports one model chunk per rank, got {len(model_chunks)} "
                         "(virtual pipeline stages are not supported)")
    if config != sender.config:  # the sender's groups, transport and staging were set up for its own
        raise ValueError(f"push_weights: config {config} is not the sender's {sender.config}: connect a sender "
                         "with it")
    pieces, error = [], None
    if sender.sends:
        try:
            pieces = list(export_hf_slices(model_chunks[0], model_cfg))
        except Exception as exc:  # every rank must hear of it rather than wait in the sync's first collective
            error = f"trainer rank {sender.rank}: exporting its slices: {error_message(exc)}"
    sender.agree(error, f"weight sync of version {weight_version}")
    return sender.send(pieces, weight_version, progress, tied=model_cfg.tie_word_embeddings)

