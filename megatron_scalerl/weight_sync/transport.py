"""Trainer rank 0's end of the broadcast group: gloo on CPUs (our receiver), NCCL on GPUs (vLLM's own engine).

`make_transport(resolve_backend("auto"), ...)` is the one switch. A transport prepares a new rendezvous per
connection (`listen`), gives each server the `/init_weight_transfer_engine` payload its receiver expects (which
travels over the servers' API-key-guarded HTTP), joins the group as rank 0 (`open`), and broadcasts buckets.

What a stranger on the network meets: gloo: a TCPStore on a free port of the one interface that faces the servers,
open only while a connection forms, whose keys all lie under a secret minted per connection (`protocol.gloo_group`);
NCCL: no store at all: vLLM's unique-id rendezvous (`nccl_unique_id_b64`), the id minted per connection by NCCL
(its bootstrap checks the id's random magic on every connection) and handed to the servers in the payload, so no
server unpickles anything read from a store a stranger could write to (vLLM's TCPStore rendezvous would).
"""

from __future__ import annotations

import base64
import ctypes
import secrets
import socket
from datetime import timedelta
from typing import Any

import torch

from megatron_scalerl.weight_sync.protocol import Bucket, gloo_group


class GlooTransport:
    """One gloo broadcast of each bucket's packed bytes (`gloo_engine.GlooWeightTransferEngine` receives it)."""

    def __init__(self) -> None:
        self.group: torch.distributed.ProcessGroup | None = None
        self._listening: socket.socket | None = None
        self.address, self.port, self.secret = "", 0, ""

    def listen(self, address: str, port: int = 0, secret: str | None = None) -> str:
        """Bind the rendezvous port on `address` only (`port`, or a free one when 0) now, so that no other process
        can take it before `open`, and mint the connection's key secret (or take `secret`); returns where the
        rendezvous is, for messages."""
        self._listening = socket.create_server((address, port))
        self.address, self.port = address, self._listening.getsockname()[1]
        self.secret = secret or secrets.token_hex(16)
        return f"{self.address}:{self.port}"

    def worker_init_info(self, rank_offset: int, world_size: int, config: Any) -> dict:
        return {"master_address": self.address, "master_port": self.port, "rendezvous_secret": self.secret,
                "rank_offset": rank_offset, "world_size": world_size, "timeout_s": config.timeout_s,
                "record_checksums": config.checksums}

    @staticmethod
    def update_extras(bucket: Bucket) -> dict:
        return {"bucket": bucket.index}

    def open(self, world_size: int, timeout_s: float) -> None:
        """Host the rendezvous (a TCPStore on the socket `listen` bound) as rank 0 and wait up to `timeout_s` s for
        every rank. Hosting it on our own socket also keeps it ours under torchrun, whose agent-store setting
        would otherwise make rank 0 a client of torchrun's store."""
        from vllm.distributed.utils import create_tcp_store

        assert self._listening is not None, "listen() first"
        listening, self._listening = self._listening, None
        timeout = timedelta(seconds=timeout_s)
        store = create_tcp_store(self.address, self.port, listen_socket=listening, world_size=world_size,
                                 is_master=True, timeout=timeout, multi_tenant=True)
        self.group = gloo_group(store, self.secret, 0, world_size, timeout, self.address)

    def broadcast(self, bucket: Bucket, timeout_s: float) -> None:
        assert self.group is not None, "open() first"
        self.group.broadcast(bucket.packed.cpu(), 0, timedelta(seconds=timeout_s)).wait()

    def close(self) -> None:
        if self._listening is not None:
            self._listening.close()
            self._listening = None
        if self.group is not None:
            self.group.shutdown()
            self.group = None


class NcclTransport:
    """vLLM's packed NCCL broadcast (`packed_nccl_broadcast_producer`, buffers of one bucket), which vLLM's
    `NCCLWeightTransferEngine` consumes. NCCL itself has no timeout: the sender bounds the wait for it."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.comm: Any = None
        self.unique_id = b""
        # The sender calls `open` and `broadcast` from its pool threads, whose current device is cuda:0 until set:
        # this rank's device, as the constructing (main) thread has it.
        self.device = torch.cuda.current_device()

    def worker_init_info(self, rank_offset: int, world_size: int, config: Any) -> dict:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        return worker_init_payload(NCCLWeightTransferInitInfo(
            nccl_unique_id_b64=base64.b64encode(self.unique_id).decode(), rank_offset=rank_offset,
            world_size=world_size, packed=True, packed_buffer_size_bytes=self.bucket_bytes, packed_num_buffers=2))

    @staticmethod
    def update_extras(bucket: Bucket) -> dict:
        return {}

    def listen(self, address: str) -> str:
        """Mint the connection's NCCL unique id (its bootstrap root listens from now on, on the interface NCCL picks,
        `NCCL_SOCKET_IFNAME` if set: `address` is not used); returns a description for messages."""
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCL_UNIQUE_ID_BYTES, NCCLLibrary

        unique_id = NCCLLibrary().ncclGetUniqueId()
        self.unique_id = ctypes.string_at(ctypes.addressof(unique_id), NCCL_UNIQUE_ID_BYTES)
        return "NCCL unique-id rendezvous"

    def open(self, world_size: int, timeout_s: float) -> None:
        """Join as rank 0 with the unique id `listen` minted; every server joins at the same time (no barrier)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        torch.cuda.set_device(self.device)
        self.comm = PyNcclCommunicator.from_unique_id_bytes(self.unique_id, rank=0, world_size=world_size,
                                                            device=self.device)

    def broadcast(self, bucket: Bucket, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        torch.cuda.set_device(self.device)
        # The bucket was exported (TP gathers, casts) by kernels queued from the main thread; vLLM's producer packs
        # on streams of its own that do not wait for them.
        torch.cuda.current_stream().synchronize()
        packed_nccl_broadcast_producer(iterator=iter(bucket.tensors()), group=self.comm, src=0,
                                       post_iter_func=lambda item: item[1], buffer_size_bytes=self.bucket_bytes,
                                       num_buffers=2)
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None


def make_transport(backend: str, *, bucket_bytes: int) -> GlooTransport | NcclTransport:
    """The transport of process-group backend `backend` ("gloo" or "nccl", from `platform.resolve_backend`)."""
    return NcclTransport(bucket_bytes) if backend == "nccl" else GlooTransport()
