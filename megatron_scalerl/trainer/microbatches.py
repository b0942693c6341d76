"""Split one step's TrainBatch over data-parallel ranks and into padded micro-batches.

Every sample stays whole inside one row of one micro-batch (no cross-sequence attention, and sequence-level losses
such as GSPO see the whole sample). Samples are dealt to DP ranks longest-first onto the rank with the fewest tokens,
so ranks carry similar token counts; every rank gets the same number of micro-batches (MoE all-to-alls and pipeline
schedules need that), padded with empty rows whose loss mask is all zero. `micro_batch_size` is the most samples a
micro-batch holds: a step takes as few micro-batches as it allows, and they are as narrow as that count allows
(a step of fewer samples than the size, e.g. after the zero-variance filter, is one micro-batch of just those rows,
not padded up to the size).

Row layout for a sample of L tokens: the model reads tokens[0 : L-1] and predicts tokens[1 : L]; `targets`,
`loss_mask`, `gen_logprobs` are the next-token quantities aligned with the inputs; `routes` (when the batch has
them) are the input tokens' own, aligned with `tokens`. Rows are right-padded to the micro-batch's longest row,
rounded up to `pad_multiple` tokens (sequence parallelism needs a multiple of tp). Padding positions route to experts
0 .. top_k-1 (valid, distinct ids: a replayed router needs some; their outputs enter no loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from megatron_scalerl.batches.train_batch import TrainBatch


@dataclass(frozen=True)
class MicroBatch:
    """[rows, seq] tensors for the model plus per-row sample data. `sample_index` is -1 for padding rows."""

    tokens: torch.Tensor  # [rows, seq] int64 model inputs
    position_ids: torch.Tensor  # [rows, seq] int64
    targets: torch.Tensor  # [rows, seq] int64 next tokens
    loss_mask: torch.Tensor  # [rows, seq] bool
    gen_logprobs: torch.Tensor  # [rows, seq] float32
    advantages: torch.Tensor  # [rows] float32
    group_ids: torch.Tensor  # [rows] int64 (padding rows: -1)
    sample_index: torch.Tensor  # [rows] int64 index into the TrainBatch, -1 for padding
    input_lengths: torch.Tensor  # [rows] int64 real input positions of each row (L - 1; 0 for padding rows)
    routes: torch.Tensor | None = None  # [rows, seq, n_moe_layers, top_k] uint8 generator routes of `tokens`

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                             for f in fields(self)})

    @property
    def input_mask(self) -> torch.Tensor:
        """[rows, seq] bool: the positions that hold a sample's input token (False: padding)."""
        seq = self.tokens.shape[1]
        return torch.arange(seq, device=self.tokens.device) < self.input_lengths[:, None]


def assign_to_ranks(lengths: list[int], dp_size: int) -> list[list[int]]:
    """Sample indices per DP rank: longest first, each to the rank with the fewest tokens so far (ties: lowest rank)."""
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(dp_size), key=lambda r: (load[r], r))
        ranks[target].append(i)
        load[target] += lengths[i]
    return ranks


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_microbatches(batch: TrainBatch, *, dp_rank: int, dp_size: int, micro_batch_size: int,
                       pad_multiple: int = 1, pad_token: int = 0) -> list[MicroBatch]:
    """This DP rank's micro-batches for the step: the same count and the same number of rows (<= micro_batch_size)
    on every rank."""
    per_rank = assign_to_ranks(batch.lengths.tolist(), dp_size)
    mine = per_rank[dp_rank]  # longest first, so consecutive rows (one micro-batch) have similar lengths
    fullest = max(1, max(len(r) for r in per_rank))
    count = math.ceil(fullest / micro_batch_size)
    width = math.ceil(fullest / count)  # rows per micro-batch
    offsets = batch.offsets.tolist()
    out = []
    for m in range(count):
        rows = mine[m * width:(m + 1) * width]
        rows += [-1] * (width - len(rows))
        seq = _round_up(max([offsets[i + 1] - offsets[i] - 1 for i in rows if i >= 0] + [1]), pad_multiple)
        tokens = torch.full((width, seq), pad_token, dtype=torch.int64)
        targets = torch.full_like(tokens, pad_token)
        loss_mask = torch.zeros((width, seq), dtype=torch.bool)
        gen_lp = torch.zeros((width, seq), dtype=torch.float32)
        routes = None if batch.routes is None else _padding_routes(width, seq, *batch.routes.shape[1:])
        input_lengths = torch.zeros(width, dtype=torch.int64)
        for row, i in enumerate(rows):
            if i < 0:
                continue
            start, end = offsets[i], offsets[i + 1]
            n = end - start - 1
            tokens[row, :n] = batch.input_ids[start:end - 1]
            targets[row, :n] = batch.input_ids[start + 1:end]
            loss_mask[row, :n] = batch.loss_mask[start + 1:end]
            gen_lp[row, :n] = batch.gen_logprobs[start + 1:end]
            input_lengths[row] = n
            if routes is not None:
                routes[row, :n] = batch.routes[start:end - 1]
        index = torch.tensor(rows, dtype=torch.int64)
        real = index >= 0
        safe = index.clamp(min=0)
        out.append(MicroBatch(
            tokens=tokens,
            position_ids=torch.arange(seq).expand(width, seq).contiguous(),
            targets=targets,
            loss_mask=loss_mask,
            gen_logprobs=gen_lp,
            advantages=torch.where(real, batch.advantages[safe], 0.0),
            group_ids=torch.where(real, batch.group_ids[safe], -1),
            sample_index=index,
            input_lengths=input_lengths,
            routes=routes,
        ))
    return out


def _padding_routes(rows: int, seq: int, moe_layers: int, top_k: int) -> torch.Tensor:
    """[rows, seq, moe_layers, top_k] uint8 routes of an all-padding micro-batch: slot j routes to expert j."""
    return torch.arange(top_k, dtype=torch.uint8).expand(rows, seq, moe_layers, top_k).clone()
