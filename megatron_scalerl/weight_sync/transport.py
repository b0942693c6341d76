"""How one sender's buckets reach every generator worker: the `WeightTransport` interface, its factory, and a
worker's loop over one sync's plan.

Each sending trainer rank owns one transport, its sender end; every generator worker holds one receiver end per
sender (`receiver.py`). One class serves both ends of each transport, so what is sent and what is received cannot
drift apart:

    sender:   endpoint = t.listen(address); (endpoint to the workers over HTTP); t.open(world, timeout_s);
              t.send(bucket, sync) for each bucket; t.close()
    receiver: t = make_transport(endpoint["transport"]); t.join(endpoint, rank, world, timeout_s);
              packed = t.receive(header, sync) for each bucket header of the plan (`receive_plan`); t.close()

Ranks in a group: the sender is 0, generator workers follow (`protocol.rank_offsets`). The transports:

  gloo, nccl   a broadcast over a process group: gloo on CPUs, NCCL on GPUs (`broadcast.py`)
  disk         safetensors files on a filesystem both sides mount (`disk.py`)
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from torch import Tensor

from megatron_scalerl.weight_sync.broadcast import GlooTransport, NcclTransport
from megatron_scalerl.weight_sync.disk import DiskTransport
from megatron_scalerl.weight_sync.protocol import Bucket, describe_header

TRANSPORTS = ("gloo", "nccl", "disk")
QUEUED_BUCKETS = 2  # received buckets a worker keeps waiting for its load, at most


class WeightTransport(Protocol):
    """One sender's link to every generator worker (see the module docstring)."""

    def listen(self, address: str) -> dict:
        """Sender: prepare a new rendezvous reachable at `address` (this host's address towards the generators);
        returns the JSON endpoint the receivers `join` (it travels over the servers' API-key-guarded HTTP)."""

    def open(self, world_size: int, timeout_s: float) -> None:
        """Sender: form the group as rank 0 of `world_size`, waiting up to `timeout_s` s for every receiver."""

    def send(self, bucket: Bucket, sync: str) -> None:
        """Sender: deliver `bucket` of sync `sync` to every receiver."""

    def join(self, endpoint: dict, rank: int, world_size: int, timeout_s: float) -> None:
        """Receiver: join the sender's group at `endpoint` as `rank`; `timeout_s` bounds every later receive."""

    def receive(self, header: dict, sync: str) -> Tensor:
        """Receiver: the packed bytes ([header["nbytes"]] uint8) of the bucket `header` describes, of sync `sync`."""

    def close(self) -> None:
        """Either end: release the group (or files)."""


def receive_plan(transports: list[WeightTransport], plan: dict, *, rank: int, timeout_s: float
                 ) -> Iterator[tuple[dict, Tensor]]:
    """A receiver's loop over one sync: (header, packed bytes) of every bucket of `plan` (its "senders": one list
    of bucket headers per sender, in the order of `transports`). Gloo and disk: each sender's buckets received by a
    thread of its own, concurrently, yielded in arrival order, at most two per sender waiting to be consumed. NCCL:
    one thread, bucket i of every sender in sender order, then bucket i + 1 (concurrent NCCL calls on several
    communicators may deadlock unless every rank issues them in the same order). A failed receive raises
    RuntimeError naming this receiver's `rank`, the sender and the bucket (`timeout_s`: the transports' timeout,
    for the message). At most `QUEUED_BUCKETS` received buckets wait to be consumed, besides one arriving per
    thread: what a worker holds in flight does not grow with the senders (`memory_plan.weight_sync_extras`)."""
    if len(plan["senders"]) != len(transports):
        raise RuntimeError(f"weight sync {plan['sync']}: the plan has {len(plan['senders'])} senders, receiver rank "
                           f"{rank} joined {len(transports)} groups (call /init_weight_transfer_engine)")
    arrived: queue.Queue = queue.Queue(maxsize=QUEUED_BUCKETS)

    def receive(work: list[tuple[int, dict]]) -> None:
        sender, header = -1, None
        try:
            for sender, header in work:
                arrived.put((header, transports[sender].receive(header, plan["sync"])))
            arrived.put(None)
        except BaseException as exc:  # handed to the consuming thread, which raises it
            what = describe_header(header) if header else "its buckets"
            arrived.put(RuntimeError(f"weight transfer rank {rank}: receiving {what} from trainer sender {sender} "
                                     f"failed ({type(exc).__name__}, timeout {timeout_s:g} s): {exc}"))

    per_sender = [[(sender, h) for h in headers] for sender, headers in enumerate(plan["senders"])]
    if any(isinstance(t, NcclTransport) for t in transports):
        rounds = itertools.zip_longest(*per_sender)
        queues = [[item for round_ in rounds for item in round_ if item is not None]]
    else:
        queues = per_sender
    for index, work in enumerate(queues):
        threading.Thread(target=receive, args=(work,), daemon=True, name=f"scalerl-weights-{index}").start()
    running = len(queues)
    while running:
        item = arrived.get()
        if item is None:
            running -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield item


def make_transport(name: str, *, directory: str | Path | None = None) -> WeightTransport:
    """The transport `name` ("gloo", "nccl" or "disk"; `directory`: the disk sender's folder)."""
    if name == "gloo":
        return GlooTransport()
    if name == "nccl":
        return NcclTransport()
    if name == "disk":
        return DiskTransport(directory)
    raise ValueError(f"unknown weight transport {name!r} (one of {', '.join(TRANSPORTS)})")
