"""The batch contract between orchestrator and trainer: `TrainBatch`, its checks and its file encoding.

A TrainBatch holds one optimizer step's samples, packed: N variable-length sequences (prompt + completion)
concatenated into 1-D token tensors, with per-sample vectors beside them.

Per-token tensors (length T = sum of `lengths`):
  input_ids int64, loss_mask bool (completion tokens that enter the loss; prompt and forced-interruption phrase
  tokens are False), gen_logprobs float32 (the generator's log-prob of each token; 0 where loss_mask is False),
  weight_versions int64 (the policy version that generated each token; -1 = `algo.versions.NO_VERSION` for prompt
  tokens).
Per-sample tensors (length N):
  lengths int64 (tokens of prompt + completion), prompt_lengths int64, advantages float32, rewards float32,
  group_ids int64 (prompt id: samples of one prompt share it), truncated bool (hit the hard length cap).
Optional, per token (None when absent: a dense model, a run without routing capture, a batch of an older run):
  routes uint8 [T, n_moe_layers, top_k]: for every token of every sample, packed like input_ids, the global expert
  ids the generator's router chose at each MoE layer (the model's MoE layers only, in model order; top-k in the
  router's order). A sample's last token never ran through the generator: its routes repeat the token before's.
  The trainer replays them (`algorithm.routing_replay`, docs/routing_replay.md). `pack_routes` builds the field
  from per-sample tensors.

On disk (`encode` / `decode`): one safetensors file; input_ids and weight_versions are stored as int32, routes (when
present) as uint8, the metadata as JSON under the key `meta`, and a CRC-32 of the tensors' bytes and the metadata
under `crc32`: a file whose bytes changed after it was written (a bad disk, a partial copy) is refused as corrupt
(CorruptBatchError), not trained on (files written before the checksum have none and are read as they are).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from megatron_scalerl.errors import UserError

TOKEN_FIELDS = {"input_ids": torch.int64, "loss_mask": torch.bool, "gen_logprobs": torch.float32,
                "weight_versions": torch.int64}
SAMPLE_FIELDS = {"lengths": torch.int64, "prompt_lengths": torch.int64, "advantages": torch.float32,
                 "rewards": torch.float32, "group_ids": torch.int64, "truncated": torch.bool}
ROUTES_DTYPE = torch.uint8  # expert ids: up to 256 experts per layer


class BatchError(UserError):
    """A TrainBatch is malformed; the message names the source and the field."""


class CorruptBatchError(BatchError):
    """A batch file that does not read back as it was written (unreadable, or its checksum differs)."""


@dataclass(frozen=True)
class TrainBatch:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    gen_logprobs: torch.Tensor
    weight_versions: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    truncated: torch.Tensor
    routes: torch.Tensor | None = None  # uint8 [T, n_moe_layers, top_k], see the module docstring

    @property
    def num_samples(self) -> int:
        return int(self.lengths.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def offsets(self) -> torch.Tensor:
        """[N + 1] start offset of each sample in the packed token tensors."""
        return torch.cat([torch.zeros(1, dtype=torch.int64), self.lengths.cumsum(0)])

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i's token tensors (views), routes included when the batch has them."""
        start, end = self.offsets[i].item(), self.offsets[i + 1].item()
        names = [*TOKEN_FIELDS, *(["routes"] if self.routes is not None else [])]
        return {name: getattr(self, name)[start:end] for name in names}

    def loss_tokens_per_sample(self) -> torch.Tensor:
        """[N] int64: loss tokens of each sample."""
        owner = torch.repeat_interleave(torch.arange(self.num_samples), self.lengths)
        return torch.zeros(self.num_samples, dtype=torch.int64).index_add_(0, owner, self.loss_mask.long())

    def validate(self, source: str, vocab_size: int | None = None, num_experts: int | None = None) -> TrainBatch:
        """Check dtypes, shapes and value ranges; raise BatchError naming `source` and the field. Token ids must be
        below `vocab_size` and expert ids (routes) below `num_experts`, where given."""

        def fail(field: str, reason: str) -> None:
            raise BatchError(f"{source}: {field}: {reason}")

        for name, dtype in {**TOKEN_FIELDS, **SAMPLE_FIELDS}.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                fail(name, f"expected a tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                fail(name, f"dtype {t.dtype}, expected {dtype}")
            if t.dim() != 1:
                fail(name, f"expected 1-D, got shape {tuple(t.shape)}")
        n, total = self.num_samples, self.num_tokens
        if n == 0:
            fail("lengths", "batch has no samples")
        for name in SAMPLE_FIELDS:
            if getattr(self, name).numel() != n:
                fail(name, f"{getattr(self, name).numel()} entries for {n} samples")
        for name in TOKEN_FIELDS:
            if getattr(self, name).numel() != total:
                fail(name, f"{getattr(self, name).numel()} entries for {total} tokens")
        if (self.lengths <= 0).any():
            fail("lengths", "every sample needs at least one token")
        if int(self.lengths.sum()) != total:
            fail("lengths", f"sum {int(self.lengths.sum())} != {total} packed tokens")
        if ((self.prompt_lengths < 1) | (self.prompt_lengths >= self.lengths)).any():
            fail("prompt_lengths", "each prompt needs >= 1 token and a completion after it")
        if (self.input_ids < 0).any() or (vocab_size is not None and (self.input_ids >= vocab_size).any()):
            fail("input_ids", f"token id outside [0, {vocab_size})")
        positions = torch.arange(total) - torch.repeat_interleave(self.offsets[:-1], self.lengths)
        in_prompt = positions < torch.repeat_interleave(self.prompt_lengths, self.lengths)
        if (self.loss_mask & in_prompt).any():
            fail("loss_mask", "prompt tokens must not enter the loss")
        lp = self.gen_logprobs[self.loss_mask]
        if not torch.isfinite(lp).all() or (lp > 1e-4).any():
            fail("gen_logprobs", "must be finite and <= 0 on loss tokens")
        if not torch.isfinite(self.advantages).all():
            fail("advantages", "must be finite")
        if ((self.weight_versions < 0) & ~in_prompt).any():
            fail("weight_versions", "every completion token needs the policy version that generated it (>= 0)")
        if self.routes is not None:
            problem = routes_problem(self.routes, total, num_experts)
            if problem:
                fail("routes", problem)
        return self


def routes_problem(routes: object, tokens: int, num_experts: int | None = None) -> str | None:
    """What is wrong with `routes` as the routes of `tokens` tokens (None: nothing): a uint8 tensor
    [tokens, n_moe_layers >= 1, top_k >= 1] of expert ids below `num_experts` (when given), the top_k ids of a token
    at a layer distinct (in any order)."""
    if not isinstance(routes, torch.Tensor):
        return f"expected a tensor, got {type(routes).__name__}"
    if routes.dtype != ROUTES_DTYPE:
        return f"dtype {routes.dtype}, expected {ROUTES_DTYPE}"
    if routes.dim() != 3 or routes.shape[1] == 0 or routes.shape[2] == 0:
        return f"expected [tokens, n_moe_layers, top_k], got shape {tuple(routes.shape)}"
    if routes.shape[0] != tokens:
        return f"{routes.shape[0]} entries for {tokens} tokens"
    if num_experts is not None and routes.numel() and int(routes.max()) >= num_experts:
        return f"expert id {int(routes.max())} outside [0, {num_experts})"
    if routes.shape[2] > 1 and routes.numel():
        ordered = routes.sort(dim=-1).values
        repeats = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1).nonzero()
        if len(repeats):
            token, layer = repeats[0].tolist()
            return (f"token {token}, MoE layer {layer}: experts {routes[token, layer].tolist()}, an id repeats (a "
                    "token's top-k experts are distinct)")
    return None


def pack_routes(per_sample: list[torch.Tensor | None], lengths: list[int]) -> torch.Tensor | None:
    """The `routes` field of a batch of samples, packed like input_ids: per_sample[i] is sample i's routes, uint8
    [lengths[i], n_moe_layers, top_k] (prompt and completion tokens), or None when it has none. None when no sample
    has routes; BatchError, naming the sample, when only some have, or when one's shape is off."""
    if len(per_sample) != len(lengths):
        raise BatchError(f"routes to pack: {len(per_sample)} samples' routes for {len(lengths)} samples")
    missing = [i for i, routes in enumerate(per_sample) if routes is None]
    if len(missing) == len(per_sample):
        return None
    if missing:
        raise BatchError(f"routes to pack: sample {missing[0]} has none, others have routes (every sample of a batch "
                         "needs them, or none)")
    for i, (routes, length) in enumerate(zip(per_sample, lengths, strict=True)):
        problem = routes_problem(routes, length)
        if problem is None and routes.shape[1:] != per_sample[0].shape[1:]:
            problem = f"shape {tuple(routes.shape)}, sample 0's is {tuple(per_sample[0].shape)}"
        if problem:
            raise BatchError(f"routes to pack: sample {i}: {problem}")
    return torch.cat(per_sample)


# Token ids and versions are stored as int32 on disk (they fit; the stream is ~40% smaller) and read back as int64.
STORED_AS_INT32 = ("input_ids", "weight_versions")


def encode(batch: TrainBatch, metadata: dict | None = None) -> bytes:
    tensors = {f.name: getattr(batch, f.name).contiguous() for f in fields(TrainBatch)
               if getattr(batch, f.name) is not None}
    for name in STORED_AS_INT32:
        if tensors[name].numel() and int(tensors[name].abs().max()) >= 2**31:
            raise BatchError(f"TrainBatch to write: {name}: values beyond int32")
        tensors[name] = tensors[name].to(torch.int32)
    meta = json.dumps(metadata or {})
    return save(tensors, metadata={"meta": meta, "crc32": str(_crc32(tensors, meta))})


def _crc32(tensors: dict[str, torch.Tensor], meta: str) -> int:
    """CRC-32 of the tensors' bytes as stored, in name order, then of the metadata's JSON."""
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return zlib.crc32(meta.encode(), crc)


def decode(path: Path) -> tuple[TrainBatch, dict]:
    try:
        with safe_open(str(path), "pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            header = handle.metadata() or {}
            meta = json.loads(header.get("meta", "{}"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptBatchError(f"{path}: unreadable TrainBatch: {exc}") from None
    if "crc32" in header:
        crc = str(_crc32(tensors, header.get("meta", "{}")))
        if crc != header["crc32"]:
            raise CorruptBatchError(f"{path}: corrupt TrainBatch: its CRC-32 is {crc}, the writer recorded "
                                    f"{header['crc32']}")
    missing = [name for name in (*TOKEN_FIELDS, *SAMPLE_FIELDS) if name not in tensors]
    if missing:
        raise BatchError(f"{path}: missing tensors {missing}")
    for name in STORED_AS_INT32:
        tensors[name] = tensors[name].to(torch.int64)
    return TrainBatch(**{f.name: tensors.get(f.name) for f in fields(TrainBatch)}), meta
