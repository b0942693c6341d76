"""Trainer rank 0's end of the broadcast group: gloo on CPUs (our receiver), NCCL on GPUs (vLLM's own engine).

`make_transport(resolve_backend("auto"), ...)` is the one switch. A transport gives each server the
`/init_weight_transfer_engine` payload its receiver expects, joins the group as rank 0, and broadcasts buckets.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch

from megatron_scalerl.platform.local_workers import free_port
from megatron_scalerl.weight_sync.protocol import Bucket


class GlooTransport:
    """One gloo broadcast of each bucket's packed bytes (`gloo_engine.GlooWeightTransferEngine` receives it)."""

    def __init__(self) -> None:
        self.group: torch.distributed.ProcessGroup | None = None
        self._listening: socket.socket | None = None

    def listen(self, address: str, port: int = 0) -> int:
        """Bind the rendezvous port (`port`, or a free one when 0) now, so that no other process can take it
        before `open`; returns it."""
        self._listening = socket.create_server((address, port))
        return self._listening.getsockname()[1]

    @staticmethod
    def worker_init_info(address: str, port: int, rank_offset: int, world_size: int, config: Any) -> dict:
        return {"master_address": address, "master_port": port, "rank_offset": rank_offset,
                "world_size": world_size, "timeout_s": config.timeout_s, "record_checksums": config.checksums}

    @staticmethod
    def update_extras(bucket: Bucket) -> dict:
        return {"bucket": bucket.index}

    def open(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        """Host the rendezvous (a TCPStore on the socket `listen` bound) as rank 0 and wait up to `timeout_s` s for
        every rank. Hosting it on our own socket also keeps it ours under torchrun, whose agent-store setting
        would otherwise make rank 0 a client of torchrun's store."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        assert self._listening is not None, "listen() first"
        listening, self._listening = self._listening, None
        self.group = stateless_init_torch_distributed_process_group(
            address, port, 0, world_size, backend="gloo", timeout=timedelta(seconds=timeout_s),
            listen_socket=listening)

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
        # The sender calls `open` and `broadcast` from its pool threads, whose current device is cuda:0 until set:
        # this rank's device, as the constructing (main) thread has it.
        self.device = torch.cuda.current_device()

    def worker_init_info(self, address: str, port: int, rank_offset: int, world_size: int, config: Any) -> dict:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        return worker_init_payload(NCCLWeightTransferInitInfo(
            master_address=address, master_port=port, rank_offset=rank_offset, world_size=world_size, packed=True,
            packed_buffer_size_bytes=self.bucket_bytes, packed_num_buffers=2))

    @staticmethod
    def update_extras(bucket: Bucket) -> dict:
        return {}

    @staticmethod
    def listen(address: str) -> int:
        """A free port for the rendezvous (vLLM's NCCL trainer side binds it itself in `open`)."""
        return free_port()

    def open(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        torch.cuda.set_device(self.device)
        self.comm = trainer_init({"master_address": address, "master_port": port, "world_size": world_size})

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
