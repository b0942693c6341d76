"""Loss aggregation and the step-wide normalisers that make it split-invariant.

An optimizer step's loss is a weighted sum of per-token objectives, with one weight per sample:

    prompt: w_i = 1 / (num_prompts * T_g(i))    T_g = loss tokens of all samples of sample i's group (prompt)
    sample: w_i = 1 / (num_samples * n_i)       n_i = loss tokens of sample i
    token:  w_i = 1 / num_tokens

so `prompt` sums each prompt's token losses, divides by that prompt's tokens and averages over prompts; `sample` is the
mean over samples of per-sample token means; `token` is the sum over the batch divided by the batch's tokens.

Data-parallel ranks and micro-batches each see part of the step. If each part computed its own counts, the parts'
losses would not add up to the step's loss. `LossNormalizers` holds the counts of the WHOLE optimizer step, computed
once; with them every sample's weight depends only on the sample and the step, so the losses (and gradients) of any
split of the step into parts sum exactly to the full-batch loss (and gradient).

A sample with no loss token (mask all zero: filtered, masked) is in no count: it is not part of the loss.
`group_ids` identify generation groups (the G samples of one prompt in this step), as int64 ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from megatron_scalerl.recipe.schema import Aggregation

AGGREGATIONS = get_args(Aggregation)


@dataclass(frozen=True, eq=False)
class LossNormalizers:
    """Counts of one optimizer step (all DP ranks, all micro-batches), in loss tokens.

    prompt_ids: [num_prompts] int64, sorted; prompt_tokens: [num_prompts] int64, the loss tokens of each of them.
    Only samples and prompts with at least one loss token are counted.
    """

    num_tokens: int
    num_samples: int
    num_prompts: int
    prompt_ids: torch.Tensor
    prompt_tokens: torch.Tensor

    @classmethod
    def from_batch(cls, mask: torch.Tensor, group_ids: torch.Tensor) -> LossNormalizers:
        """From the whole step's loss mask [num_samples, seq_len] and group ids [num_samples]."""
        return cls.from_sample_tokens(torch.count_nonzero(mask, dim=-1), group_ids)

    @classmethod
    def from_sample_tokens(cls, sample_tokens: torch.Tensor, group_ids: torch.Tensor) -> LossNormalizers:
        """From the loss-token count of every sample of the step [num_samples] and their group ids [num_samples].

        The trainer knows every sample's length from the batch metadata, so each rank can build the step's
        normalisers without seeing the other ranks' tokens.
        """
        if sample_tokens.shape != group_ids.shape or sample_tokens.dim() != 1:
            raise ValueError(f"sample_tokens {tuple(sample_tokens.shape)} and group_ids {tuple(group_ids.shape)} "
                             "must both be [num_samples]")
        sample_tokens = sample_tokens.detach().to("cpu", torch.int64)
        group_ids = group_ids.detach().to("cpu", torch.int64)
        counted = sample_tokens > 0
        prompt_ids, inverse = torch.unique(group_ids[counted], sorted=True, return_inverse=True)
        prompt_tokens = torch.zeros(len(prompt_ids), dtype=torch.int64).index_add_(0, inverse, sample_tokens[counted])
        return cls(num_tokens=int(sample_tokens.sum()), num_samples=int(counted.sum()), num_prompts=len(prompt_ids),
                   prompt_ids=prompt_ids, prompt_tokens=prompt_tokens)

    @classmethod
    def combine(cls, parts: list[LossNormalizers]) -> LossNormalizers:
        """The step's normalisers from those of disjoint parts of it (e.g. gathered from every DP rank).

        A prompt whose samples are spread over several parts is one prompt: its token counts are added.
        """
        if not parts:
            raise ValueError("combine needs at least one LossNormalizers")
        ids = torch.cat([p.prompt_ids for p in parts])
        tokens = torch.cat([p.prompt_tokens for p in parts])
        prompt_ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        prompt_tokens = torch.zeros(len(prompt_ids), dtype=torch.int64).index_add_(0, inverse, tokens)
        return cls(num_tokens=sum(p.num_tokens for p in parts), num_samples=sum(p.num_samples for p in parts),
                   num_prompts=len(prompt_ids), prompt_ids=prompt_ids, prompt_tokens=prompt_tokens)

    def group_tokens(self, group_ids: torch.Tensor) -> torch.Tensor:
        """T_g for each sample's group [num_samples] int64 (0 for a group with no loss token in this step)."""
        ids = group_ids.detach().to("cpu", torch.int64)
        if self.num_prompts == 0:
            return torch.zeros_like(ids)
        position = torch.searchsorted(self.prompt_ids, ids).clamp_(max=self.num_prompts - 1)
        found = self.prompt_ids[position] == ids
        return torch.where(found, self.prompt_tokens[position], 0)

    def sample_weights(self, aggregation: str, sample_tokens: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """w_i of the module docstring for the samples of one part of the step: [num_samples] float64, on CPU.

        sample_tokens: loss tokens of each sample of this part [num_samples]; group_ids: [num_samples].
        """
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation '{aggregation}' (known: {', '.join(AGGREGATIONS)})")
        tokens = sample_tokens.detach().to("cpu", torch.int64)
        counted = tokens > 0
        if int(tokens.sum()) > self.num_tokens:
            raise ValueError(f"this part has {int(tokens.sum())} loss tokens but the step's normalizers count "
                             f"{self.num_tokens}: they were computed for a different step")
        if aggregation == "token":
            weights = torch.full(tokens.shape, 1.0 / max(self.num_tokens, 1), dtype=torch.float64)
        elif aggregation == "sample":
            weights = 1.0 / (max(self.num_samples, 1) * tokens.clamp(min=1).double())
        else:
            group_tokens = self.group_tokens(group_ids)
            missing = counted & (group_tokens < tokens)
            if bool(missing.any()):
                bad = int(group_ids.detach().cpu()[missing][0])
                raise ValueError(f"group id {bad} has more loss tokens in this part than the step's normalizers "
                                 "count for it (normalizers computed for a different step?)")
            weights = 1.0 / (max(self.num_prompts, 1) * group_tokens.clamp(min=1).double())
        return torch.where(counted, weights, 0.0)
