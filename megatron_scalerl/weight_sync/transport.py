"""How one sender's buckets reach every generator worker: the `WeightTransport` interface and its three transports.

Each sending trainer rank owns one transport, its sender end; every generator worker holds one receiver end per
sender (`inference/weight_receiver.py`). The same classes serve both ends, so what is sent and what is received
cannot drift apart:

    sender:   endpoint = t.listen(address); (endpoint to the workers over HTTP); t.open(world, timeout_s);
              t.send(bucket, sync) for each bucket; t.close()
    receiver: t = make_transport(endpoint["transport"]); t.join(endpoint, rank, world, timeout_s);
              packed = t.receive(header, sync) for each bucket header of the plan; t.close()

Ranks in a group: the sender is 0, generator workers follow (`protocol.rank_offsets`).

  gloo   a gloo broadcast group (CPUs). A stranger on the network meets a TCPStore on a free port of the one
         interface that faces the servers, open only while a connection forms, whose keys all lie under a secret
         minted per connection (`protocol.gloo_group`) and handed to the workers over the API-key-guarded route.
  nccl   an NCCL communicator (GPUs), vLLM's `PyNcclCommunicator` from a unique id minted per connection by NCCL and
         handed over the same route: no store, nothing unpickled from the network. NCCL has no timeout of its own:
         the sender bounds its wait for it.
  disk   safetensors files on a filesystem both sides mount (`directory`/SYNC/bucket-NNNNN.safetensors, written
         atomically; each sync's files are removed at the sender's next sync), for generators the trainer cannot
         reach over a process group; the receiver waits up to the timeout for each file.
"""

from __future__ import annotations

import base64
import ctypes
import itertools
import json
import queue
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor

from megatron_scalerl.weight_sync.protocol import (
    SYNC_TIMEOUT_S,
    Bucket,
    describe_header,
    gloo_group,
    join_gloo_group,
)

TRANSPORTS = ("gloo", "nccl", "disk")
DISK_POLL_S = 0.05


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


class GlooTransport:
    """A gloo broadcast of each bucket's packed bytes."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self._listening: socket.socket | None = None
        self.address, self.port, self.secret = "", 0, ""
        self.timeout = timedelta(seconds=SYNC_TIMEOUT_S)

    def listen(self, address: str) -> dict:
        """Bind the rendezvous port on `address` only, now (no other process can take it before `open`), and mint
        the connection's key secret."""
        self._listening = socket.create_server((address, 0))
        self.address, self.port = address, self._listening.getsockname()[1]
        self.secret = secrets.token_hex(16)
        return {"transport": "gloo", "address": self.address, "port": self.port, "secret": self.secret}

    def open(self, world_size: int, timeout_s: float) -> None:
        """Host the rendezvous (a TCPStore on the socket `listen` bound) as rank 0. Hosting it on our own socket
        also keeps it ours under torchrun, whose agent-store setting would make rank 0 a client of its store."""
        from vllm.distributed.utils import create_tcp_store  # deferred: vLLM is imported only where servers are

        assert self._listening is not None, "listen() first"
        listening, self._listening = self._listening, None
        self.timeout = timedelta(seconds=timeout_s)
        store = create_tcp_store(self.address, self.port, listen_socket=listening, world_size=world_size,
                                 is_master=True, timeout=self.timeout, multi_tenant=True)
        self.group = gloo_group(store, self.secret, 0, world_size, self.timeout, self.address)

    def send(self, bucket: Bucket, sync: str) -> None:
        assert self.group is not None, "open() first"
        self.group.broadcast(bucket.packed.cpu(), 0, self.timeout).wait()

    def join(self, endpoint: dict, rank: int, world_size: int, timeout_s: float) -> None:
        self.address, self.port = endpoint["address"], endpoint["port"]
        self.timeout = timedelta(seconds=timeout_s)
        self.group = join_gloo_group(self.address, self.port, endpoint["secret"], rank, world_size, self.timeout)

    def receive(self, header: dict, sync: str) -> Tensor:
        assert self.group is not None, "join() first"
        packed = torch.empty(header["nbytes"], dtype=torch.uint8)
        self.group.broadcast(packed, 0, self.timeout).wait()
        return packed

    def close(self) -> None:
        if self._listening is not None:
            self._listening.close()
            self._listening = None
        if self.group is not None:
            self.group.shutdown()
            self.group = None


class NcclTransport:
    """An NCCL broadcast of each bucket's packed bytes on this process's CUDA device, on a stream of its own (so
    neither the trainer's nor vLLM's stream waits on it), every wait on it bounded by the timeout: past it, the
    communicator is aborted and the call raises."""

    def __init__(self) -> None:
        self.comm = None
        self.unique_id = b""
        # The receiver's threads start on cuda:0: this process's device, as the constructing (main) thread has it.
        self.device = torch.cuda.current_device()
        self.stream = torch.cuda.Stream(self.device)
        self.timeout_s = SYNC_TIMEOUT_S

    def listen(self, address: str) -> dict:
        """Mint the connection's NCCL unique id (its bootstrap root listens from now on, on the interface NCCL picks,
        `NCCL_SOCKET_IFNAME` if set: `address` is not used)."""
        from vllm.distributed.device_communicators.pynccl_wrapper import (  # deferred: CUDA only
            NCCL_UNIQUE_ID_BYTES,
            NCCLLibrary,
        )

        unique_id = NCCLLibrary().ncclGetUniqueId()
        self.unique_id = ctypes.string_at(ctypes.addressof(unique_id), NCCL_UNIQUE_ID_BYTES)
        return {"transport": "nccl", "unique_id": base64.b64encode(self.unique_id).decode()}

    def _connect(self, rank: int, world_size: int, timeout_s: float) -> None:
        """Join the communicator (NCCL's init waits for every rank; it cannot be bounded from here)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # deferred: CUDA only

        self.timeout_s = timeout_s
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.stream):
            self.comm = PyNcclCommunicator.from_unique_id_bytes(self.unique_id, rank=rank, world_size=world_size,
                                                                device=self.device)
        if self.comm.disabled:  # e.g. VLLM_DISABLE_PYNCCL=1: its broadcasts would do nothing
            raise RuntimeError("vLLM's NCCL communicator is disabled here (VLLM_DISABLE_PYNCCL?): "
                               "weight_sync.transport nccl cannot run")

    def _broadcast(self, tensor: Tensor) -> None:
        """`tensor` from rank 0 to every rank; waits for it, at most `timeout_s` s (then aborts the communicator)."""
        torch.cuda.set_device(self.device)
        watchdog = threading.Timer(self.timeout_s, self.close)
        watchdog.start()
        try:
            self.comm.broadcast(tensor, src=0, stream=self.stream)
            self.stream.synchronize()
        finally:
            watchdog.cancel()
        if self.comm is None:
            raise TimeoutError(f"NCCL broadcast of {tensor.numel()} bytes not complete within {self.timeout_s:g} s")

    def open(self, world_size: int, timeout_s: float) -> None:
        self._connect(0, world_size, timeout_s)

    def send(self, bucket: Bucket, sync: str) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the bucket was packed on the caller's stream
        with torch.cuda.stream(self.stream):
            packed = bucket.packed.to(f"cuda:{self.device}", non_blocking=True)
        self._broadcast(packed)

    def join(self, endpoint: dict, rank: int, world_size: int, timeout_s: float) -> None:
        self.unique_id = base64.b64decode(endpoint["unique_id"])
        self._connect(rank, world_size, timeout_s)

    def receive(self, header: dict, sync: str) -> Tensor:
        """The bytes, complete when this returns; a consumer on another stream must `record_stream` them before it
        drops them (`weight_receiver` does), so their memory is not reused under its reads."""
        with torch.cuda.stream(self.stream):
            packed = torch.empty(header["nbytes"], dtype=torch.uint8, device=f"cuda:{self.device}")
        self._broadcast(packed)
        return packed

    def close(self) -> None:
        if self.comm is not None:
            comm, self.comm = self.comm, None
            comm.destroy()


class DiskTransport:
    """Each bucket as a safetensors file (one uint8 tensor `packed`, the header in the file's metadata) under the
    sender's own `directory`, one folder per sync."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.timeout_s = SYNC_TIMEOUT_S
        self.current = ""  # the sync whose files the sender wrote last

    def listen(self, address: str) -> dict:
        assert self.directory is not None, "a disk sender needs its directory"
        self.directory.mkdir(parents=True, exist_ok=True)
        return {"transport": "disk", "directory": str(self.directory)}

    def open(self, world_size: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def path(self, sync: str, index: int) -> Path:
        return self.directory / sync / f"bucket-{index:05d}.safetensors"

    def send(self, bucket: Bucket, sync: str) -> None:
        if sync != self.current:  # the previous sync's files were read (its update was applied or abandoned)
            self._remove_syncs()
            self.current = sync
        path = self.path(sync, bucket.index)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        save_file({"packed": bucket.packed.cpu()}, str(partial), metadata={"header": json.dumps(bucket.header())})
        partial.replace(path)

    def join(self, endpoint: dict, rank: int, world_size: int, timeout_s: float) -> None:
        self.directory, self.timeout_s = Path(endpoint["directory"]), timeout_s

    def receive(self, header: dict, sync: str) -> Tensor:
        path = self.path(sync, header["index"])
        deadline = time.monotonic() + self.timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: not written within {self.timeout_s:g} s ({describe_header(header)})")
            time.sleep(DISK_POLL_S)
        packed = load_file(str(path))["packed"]
        if packed.numel() != header["nbytes"]:
            raise ValueError(f"{path}: {packed.numel()} bytes, the plan says {header['nbytes']}")
        return packed

    def _remove_syncs(self) -> None:
        for old in self.directory.iterdir() if self.directory.exists() else ():
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self.current:
            self._remove_syncs()
            self.current = ""


def receive_plan(transports: list[WeightTransport], plan: dict, *, rank: int, timeout_s: float
                 ) -> Iterator[tuple[dict, Tensor]]:
    """A receiver's loop over one sync: (header, packed bytes) of every bucket of `plan` (its "senders": one list
    of bucket headers per sender, in the order of `transports`). Gloo and disk: each sender's buckets received by a
    thread of its own, concurrently, yielded in arrival order, at most two per sender waiting to be consumed. NCCL:
    one thread, bucket i of every sender in sender order, then bucket i + 1 (concurrent NCCL calls on several
    communicators may deadlock unless every rank issues them in the same order). A failed receive raises
    RuntimeError naming this receiver's `rank`, the sender and the bucket (`timeout_s`: the transports' timeout,
    for the message)."""
    if len(plan["senders"]) != len(transports):
        raise RuntimeError(f"weight sync {plan['sync']}: the plan has {len(plan['senders'])} senders, receiver rank "
                           f"{rank} joined {len(transports)} groups (call /init_weight_transfer_engine)")
    arrived: queue.Queue = queue.Queue(maxsize=2 * max(1, len(transports)))

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
