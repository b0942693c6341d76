"""What trainer and servers agree on: the pieces a sender sends, buckets and their headers (a sync's plan), how
received slices become whole tensors (`Assembler`), dtype names, the groups' ranks, per-slice checksums, and the
address a group meets on.

Shared by the trainer side (`sender`, `fleet_control`) and the receiving side in the vLLM workers (`receiver`), and
by the transports both use (`transport`, `broadcast`, `disk`). Pure: it imports torch and nothing of the package,
so a generator's worker that imports it pulls in nothing of the trainer. Which dtype a tensor travels in is the
sender's choice (`sender.wire_dtype`), written into each bucket's header.
"""

from __future__ import annotations

import hashlib
import math
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# The only tensor that keeps FP32 on the wire and on the server when `fp32_lm_head` is on: the LM head, which with
# tied embeddings is the embedding (one tensor; the server keeps its embedding in the serving dtype and an FP32 copy
# as the head, `fp32_head.make_lm_head_fp32`).
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
MIB = 1024 * 1024
SYNC_TIMEOUT_S = 120.0  # the default bound (seconds) on each HTTP call, receive and rendezvous of a sync


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the server (or trainer peer) and the bucket."""


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's spelling of a dtype in update infos: `torch.bfloat16` -> "bfloat16" (read back with getattr(torch, .))."""
    return str(dtype).removeprefix("torch.")


def checksum(tensor: Tensor) -> str:
    """SHA-256 (first 16 hex digits) of a tensor's bytes in its own dtype, the same on trainer and server."""
    data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def packed_sizes(dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[int]:
    """Bytes of each tensor in a packed bucket."""
    return [torch.Size(shape).numel() * d.itemsize for d, shape in zip(dtypes, shapes, strict=True)]


@dataclass(frozen=True)
class Piece:
    """What travels: HF tensor `name`'s box at `start` ([dims]) of shape `tensor.shape` in a tensor of `full_shape`
    (`models.mapping.HFSlice` has these fields; a whole tensor is `Piece.whole(name, tensor)`)."""

    name: str
    tensor: Tensor
    full_shape: tuple[int, ...]
    start: tuple[int, ...]

    @classmethod
    def whole(cls, name: str, tensor: Tensor) -> Piece:
        return cls(name, tensor, tuple(tensor.shape), (0,) * tensor.dim())

    @classmethod
    def of(cls, item: Any) -> Piece:
        """A (name, whole tensor) pair or an object with Piece's fields, as a Piece."""
        if isinstance(item, tuple):
            return cls.whole(*item)
        return item if isinstance(item, cls) else cls(item.name, item.tensor, item.full_shape, item.start)

    def cast(self, dtype: torch.dtype) -> Piece:
        return self if self.tensor.dtype == dtype else Piece(self.name, self.tensor.to(dtype), self.full_shape,
                                                             self.start)


def group_buckets(pieces: list[Piece], bucket_bytes: int, dtype_of: Callable[[str], torch.dtype]
                  ) -> list[list[Piece]]:
    """Pieces in order, grouped into buckets of at most `bucket_bytes` bytes once cast to `dtype_of(name)` (an
    oversized piece alone) and of one dtype (every tensor starts at a multiple of its element size when packed)."""
    groups: list[list[Piece]] = []
    size, dtype = 0, None
    for piece in pieces:
        wire = dtype_of(piece.name)
        nbytes = piece.tensor.numel() * wire.itemsize
        if not groups or size + nbytes > bucket_bytes and size or wire != dtype:
            groups.append([])
            size, dtype = 0, wire
        groups[-1].append(piece)
        size += nbytes
    return groups


def bucket_header(index: int, pieces: list[Piece], dtype_of: Callable[[str], torch.dtype]) -> dict:
    """`Bucket.header` of the bucket `pieces` make once cast to `dtype_of(name)`, without packing them."""
    dtypes = [dtype_of(p.name) for p in pieces]
    shapes = [list(p.tensor.shape) for p in pieces]
    return {"index": index, "names": [p.name for p in pieces], "dtype_names": [dtype_name(d) for d in dtypes],
            "shapes": shapes, "full_shapes": [list(p.full_shape) for p in pieces],
            "starts": [list(p.start) for p in pieces], "nbytes": sum(packed_sizes(dtypes, shapes))}


def slice_key(name: str, start: list[int] | tuple[int, ...]) -> str:
    """How a slice of an HF tensor is named in checksum reports: "model.layers.0.mlp.down_proj.weight[0,64]"."""
    return f"{name}[{','.join(str(i) for i in start)}]"


@dataclass
class Bucket:
    """Slices of HF-named tensors packed back to back into one uint8 buffer (`packed`, [sum of their bytes]): one
    broadcast from one sender. Slice i is `names[i]`[starts[i][0] : starts[i][0] + shapes[i][0], ...] of a tensor of
    shape `full_shapes[i]` (a whole tensor: `starts[i]` all 0 and `shapes[i] == full_shapes[i]`). `index` counts from
    0 within one sender's sync."""

    index: int
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    full_shapes: list[list[int]]
    starts: list[list[int]]
    packed: Tensor

    @classmethod
    def pack(cls, index: int, pieces: list[Piece]) -> Bucket:
        """The pieces' bytes back to back (a lone contiguous tensor's own storage: no copy)."""
        flat = [p.tensor.contiguous().view(-1).view(torch.uint8) for p in pieces]
        packed = flat[0] if len(flat) == 1 else torch.cat(flat)
        return cls(index, [p.name for p in pieces], [p.tensor.dtype for p in pieces],
                   [list(p.tensor.shape) for p in pieces], [list(p.full_shape) for p in pieces],
                   [list(p.start) for p in pieces], packed)

    @property
    def nbytes(self) -> int:
        return int(self.packed.numel())

    def tensors(self) -> list[tuple[str, Tensor]]:
        """(name, view into `packed`) of each slice with its dtype and shape."""
        return unpack(self.packed, self.names, self.shapes, self.dtypes)

    def header(self) -> dict:
        """Everything but the bytes, as plain JSON (the plan's entry for this bucket)."""
        return {"index": self.index, "names": self.names, "dtype_names": [dtype_name(d) for d in self.dtypes],
                "shapes": self.shapes, "full_shapes": self.full_shapes, "starts": self.starts, "nbytes": self.nbytes}

    @classmethod
    def empty_from_header(cls, header: dict, device: torch.device) -> Bucket:
        """A bucket with `header`'s slices and an uninitialised buffer to receive `packed` into."""
        dtypes = [getattr(torch, n) for n in header["dtype_names"]]
        size = sum(packed_sizes(dtypes, header["shapes"]))
        return cls(header["index"], header["names"], dtypes, header["shapes"], header["full_shapes"],
                   header["starts"], torch.empty(size, dtype=torch.uint8, device=device))

    def checksums(self) -> dict[str, str]:
        """`checksum` of each slice, by `slice_key`."""
        return {slice_key(name, start): checksum(tensor)
                for (name, tensor), start in zip(self.tensors(), self.starts, strict=True)}

    def describe(self) -> str:
        """For error messages: "bucket 3 (12 tensors, 4.0 MiB: model.layers.2.… .. lm_head.weight)"."""
        return describe_header(self.header())


def describe_header(header: dict) -> str:
    """`Bucket.describe` from a bucket's header."""
    names = header["names"]
    span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    return f"bucket {header['index']} ({len(names)} tensors, {header['nbytes'] / MIB:.1f} MiB: {span})"


def unpack(packed: Tensor, names: list[str], shapes: list[list[int]], dtypes: list[torch.dtype]
           ) -> list[tuple[str, Tensor]]:
    """(name, view into `packed`) of each tensor packed back to back."""
    out, offset = [], 0
    for name, shape, dtype, size in zip(names, shapes, dtypes, packed_sizes(dtypes, shapes), strict=True):
        out.append((name, packed[offset:offset + size].view(dtype).view(shape)))
        offset += size
    return out


class Assembler:
    """Whole HF tensors from the slices of received buckets, in any order (`add` returns those it completed).

    A slice that is a whole tensor is passed on as the view into its bucket it is; the slices of a split one are
    copied into a tensor of its full shape (allocated at its first slice, on its device) until its elements are all
    there. A slice that falls outside its tensor, or one whose dtype or full shape disagrees with earlier slices of
    the same name, is refused (ValueError naming the tensor)."""

    def __init__(self) -> None:
        self.partial: dict[str, tuple[Tensor, int]] = {}  # name -> (full tensor, elements still missing)

    def add(self, header: dict, packed: Tensor) -> list[tuple[str, Tensor]]:
        dtypes = [getattr(torch, n) for n in header["dtype_names"]]
        done = []
        views = unpack(packed, header["names"], header["shapes"], dtypes)
        for (name, piece), full_shape, start in zip(views, header["full_shapes"], header["starts"], strict=True):
            if list(piece.shape) == list(full_shape):
                done.append((name, piece))
                continue
            full, missing = self.partial.get(name) or (
                torch.empty(full_shape, dtype=piece.dtype, device=piece.device), math.prod(full_shape))
            if list(full.shape) != list(full_shape) or full.dtype != piece.dtype:
                raise ValueError(f"{name}: a slice of shape {list(full_shape)} {piece.dtype} after slices of "
                                 f"{list(full.shape)} {full.dtype}")
            box = tuple(slice(s, s + n) for s, n in zip(start, piece.shape, strict=True))
            if any(s < 0 or s + n > f for s, n, f in zip(start, piece.shape, full_shape, strict=True)):
                raise ValueError(f"{name}: slice at {start} of shape {list(piece.shape)} outside {list(full_shape)}")
            full[box].copy_(piece)
            missing -= piece.numel()
            if missing:
                self.partial[name] = (full, missing)
            else:
                self.partial.pop(name, None)
                done.append((name, full))
        return done

    def incomplete(self) -> list[str]:
        """Names of tensors some of whose slices have not arrived."""
        return list(self.partial)


def rank_offsets(world_sizes: list[int]) -> tuple[list[int], int]:
    """Ranks of a sender's group: the sender is rank 0, server i's workers follow the servers before it.

    `world_sizes[i]`: server i's worker count (TP x PP x DP). Returns (rank offset of each server, group size);
    a worker's rank is its server's offset + its global worker rank (vLLM's rule: dp index x TP x PP + worker rank).
    """
    offsets, next_rank = [], 1
    for size in world_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


def host_available_bytes(meminfo: Path | None = None) -> int | None:
    """This host's available memory, MemAvailable of `meminfo` (default /proc/meminfo; bytes), what staging a sync
    in host memory can take; None where it cannot be read."""
    try:
        text = (meminfo or Path("/proc/meminfo")).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable" and value.split():
            return int(value.split()[0]) * 1024  # kB
    return None


def local_address_towards(host: str) -> str:
    """This machine's IPv4 address on the route to `host` (a name or an address): the interface a peer there reaches
    us on."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # UDP: no packet is sent
        return probe.getsockname()[0]



def in_background(fn: Callable[[], Any], name: str) -> Future:
    """`fn()` started in a daemon thread of its own: a future of its result or its exception."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name=name).start()
    return future


def call_within(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """`fn()`'s result (or its exception) for a wait that cannot be bounded from inside, such as NCCL's blocking
    communicator init: run in a thread of its own, TimeoutError naming `what` once `timeout_s` seconds pass. The
    thread is then left behind, blocked, until the process ends (NCCL's init cannot be aborted)."""
    future = in_background(fn, "scalerl-bounded-wait")
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        if not future.done():
            raise TimeoutError(f"{what}: not done within {timeout_s:g} s") from None
        raise
