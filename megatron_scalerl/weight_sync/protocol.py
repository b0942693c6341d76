"""What trainer and servers agree on: buckets, wire dtypes, the broadcast group's ranks, per-tensor checksums, and
how the gloo broadcast group meets.

Shared by the trainer side (`export`, `sender`, `transport`) and the server side (`gloo_engine`), and light to import
(torch only; vLLM's unpacking helper is imported where it is used).

The gloo group's rendezvous is a TCPStore hosted by trainer rank 0 on one interface (`local_address_towards` the
servers). The store has no authentication: whoever connects may read and write any key it can name. So every key of
the group lives under a per-connection secret (`gloo_group`: a `PrefixStore`), which the trainer mints for each
connection and hands each server inside its `/init_weight_transfer_engine` payload, over the API-key-guarded route;
gloo's own connections listen on that same interface.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

# The worker extension's refusal to convert the LM head while a weight update holds it empty (callers retry on it).
WEIGHT_UPDATE_IN_PROGRESS = "the LM head is being reloaded by a weight update"
# The only tensor that keeps FP32 on the wire and on the server when `fp32_lm_head` is on: the LM head, which with
# tied embeddings is the embedding (one tensor; the server keeps its embedding in the serving dtype and an FP32 copy
# as the head, `fp32_head.make_lm_head_fp32`).
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
MIB = 1024 * 1024


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the server (or trainer peer) and the bucket."""


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's spelling of a dtype in update infos: `torch.bfloat16` -> "bfloat16" (read back with getattr(torch, .))."""
    return str(dtype).removeprefix("torch.")


def head_tensor(tied: bool) -> str:
    """The HF name of the tensor that holds the LM head: the embedding when `tied` (`tie_word_embeddings`)."""
    return EMBEDDING if tied else LM_HEAD


def wire_dtype(name: str, serving_dtype: torch.dtype, fp32_lm_head: bool, *, tied: bool) -> torch.dtype:
    """The dtype an HF tensor travels in: FP32 for the LM head's tensor (`head_tensor(tied)`) with `fp32_lm_head`,
    else the serving dtype."""
    return torch.float32 if fp32_lm_head and name == head_tensor(tied) else serving_dtype


def checksum(tensor: Tensor) -> str:
    """SHA-256 (first 16 hex digits) of a tensor's bytes in its own dtype, the same on trainer and server."""
    data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def packed_sizes(dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[int]:
    """Bytes of each tensor in a packed bucket."""
    return [torch.Size(shape).numel() * d.itemsize for d, shape in zip(dtypes, shapes, strict=True)]


@dataclass
class Bucket:
    """Some HF-named full tensors packed back to back into one uint8 buffer (`packed`, [sum of their bytes]) on the
    trainer's device: one `/update_weights` call and one broadcast. `index` counts from 0 within one sync."""

    index: int
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    packed: Tensor

    @classmethod
    def pack(cls, index: int, named: list[tuple[str, Tensor]]) -> Bucket:
        """The tensors' bytes back to back (a lone tensor's own storage when it is contiguous: no copy)."""
        flat = [t.contiguous().view(-1).view(torch.uint8) for _, t in named]
        packed = flat[0] if len(flat) == 1 else torch.cat(flat)
        return cls(index, [n for n, _ in named], [t.dtype for _, t in named], [list(t.shape) for _, t in named],
                   packed)

    @property
    def nbytes(self) -> int:
        return int(self.packed.numel())

    def tensors(self) -> list[tuple[str, Tensor]]:
        """(name, view into `packed`) with each tensor's dtype and shape."""
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

        return unpack_tensor(self.packed, self.names, self.shapes, self.dtypes, packed_sizes(self.dtypes, self.shapes))

    def header(self) -> dict:
        """Everything but the bytes, as plain Python (sent ahead of `packed` between trainer ranks)."""
        return {"index": self.index, "names": self.names, "dtype_names": [dtype_name(d) for d in self.dtypes],
                "shapes": self.shapes}

    @classmethod
    def empty_from_header(cls, header: dict, device: torch.device) -> Bucket:
        """A bucket with `header`'s tensors and an uninitialised buffer to receive `packed` into."""
        dtypes = [getattr(torch, n) for n in header["dtype_names"]]
        size = sum(packed_sizes(dtypes, header["shapes"]))
        return cls(header["index"], header["names"], dtypes, header["shapes"],
                   torch.empty(size, dtype=torch.uint8, device=device))

    def update_info(self) -> dict:
        """The `/update_weights` payload of vLLM's dense backends (names, dtype_names, shapes)."""
        header = self.header()
        return {"names": header["names"], "dtype_names": header["dtype_names"], "shapes": header["shapes"]}

    def describe(self) -> str:
        """For error messages: "bucket 3 (12 tensors, 4.0 MiB: model.layers.2.… .. lm_head.weight)"."""
        span = self.names[0] if len(self.names) == 1 else f"{self.names[0]} .. {self.names[-1]}"
        return f"bucket {self.index} ({len(self.names)} tensors, {self.nbytes / MIB:.1f} MiB: {span})"


def rank_offsets(world_sizes: list[int]) -> tuple[list[int], int]:
    """Ranks of the broadcast group: trainer rank 0 is rank 0, server i's workers follow the servers before it.

    `world_sizes[i]`: server i's worker count (TP x PP x DP). Returns (rank offset of each server, group size);
    a worker's rank is its server's offset + its global worker rank (vLLM's rule: dp index x TP x PP + worker rank).
    """
    offsets, next_rank = [], 1
    for size in world_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


def local_address_towards(host: str) -> str:
    """This machine's IPv4 address on the route to `host` (a name or an address): the interface a peer there reaches
    us on."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # UDP: no packet is sent
        return probe.getsockname()[0]


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
