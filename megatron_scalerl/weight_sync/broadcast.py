"""The broadcast transports, both ends in one class each: every bucket's packed bytes broadcast from the sender
(rank 0 of its group) to every generator worker in it (`transport.WeightTransport`'s methods: the sender's `listen`,
`open`, `send`; a worker's `join`, `receive`).

  gloo   `GlooTransport`, a gloo process group (CPUs). Every sending trainer rank hosts its group's rendezvous, a
         TCPStore on one interface (`protocol.local_address_towards` the servers), open only while a connection
         forms. The store has no authentication: whoever connects may read and write any key it can name. So every
         key of the group lives under a per-connection secret (`gloo_group`: a `PrefixStore`), which the sender
         mints for each connection and hands each server inside its `/init_weight_transfer_engine` payload, over the
         API-key-guarded route; gloo's own connections listen on that same interface.
  nccl   `NcclTransport`, an NCCL communicator (GPUs), vLLM's `PyNcclCommunicator` from a unique id minted per
         connection by NCCL and handed over the same route: no store, nothing unpickled from the network. NCCL has no
         timeout of its own: each end bounds its connect and every broadcast by the sync's timeout.
"""

from __future__ import annotations

import base64
import ctypes
import secrets
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_scalerl.weight_sync.protocol import SYNC_TIMEOUT_S, Bucket, call_within, local_address_towards


def gloo_group(store: dist.Store, secret: str, rank: int, world_size: int, timeout: timedelta,
               address: str) -> dist.ProcessGroup:
    """The weight broadcast group over gloo as rank `rank` of `world_size`, met through `store` (the trainer's
    TCPStore, hosted or joined) with every key under `secret`, gloo's connections listening on `address` (this
    process's address towards its peers); `timeout` bounds every collective. Built as vLLM's
    `stateless_init_torch_distributed_process_group` builds it, which takes neither a key prefix of ours nor an
    address for gloo."""
    prefixed = dist.PrefixStore(f"scalerl-weights/{secret}/", store)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    backend = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    group = dist.ProcessGroup(prefixed, rank, world_size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def join_gloo_group(address: str, port: int, secret: str, rank: int, world_size: int,
                    timeout: timedelta) -> dist.ProcessGroup:
    """A server worker's (or any non-zero rank's) end of `gloo_group`: a client of the trainer's TCPStore at
    `address`:`port`, waiting up to `timeout` for it."""
    store = dist.TCPStore(host_name=address, port=port, world_size=world_size, is_master=False, timeout=timeout,
                          multi_tenant=True)
    return gloo_group(store, secret, rank, world_size, timeout, local_address_towards(address))


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
        """Join the communicator as `rank` of `world_size`, within `timeout_s` s: NCCL's init waits for every rank
        and has no timeout of its own, so it runs in a thread of its own (`protocol.call_within`); past the
        deadline a TimeoutError says which rank waited for how many, and the peers' own errors say why one never
        came (the sender's `connect` reports every server's answer)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # deferred: CUDA only

        self.timeout_s = timeout_s

        def init() -> PyNcclCommunicator:
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self.stream):
                return PyNcclCommunicator.from_unique_id_bytes(self.unique_id, rank=rank, world_size=world_size,
                                                               device=self.device)

        self.comm = call_within(init, timeout_s, f"NCCL weight group: rank {rank} waiting for all {world_size} ranks "
                                                 "to join (a generator worker or the trainer sender did not)")
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
        drops them (`receiver` does), so their memory is not reused under its reads."""
        with torch.cuda.stream(self.stream):
            packed = torch.empty(header["nbytes"], dtype=torch.uint8, device=f"cuda:{self.device}")
        self._broadcast(packed)
        return packed

    def close(self) -> None:
        if self.comm is not None:
            comm, self.comm = self.comm, None
            comm.destroy()
