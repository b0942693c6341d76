"""Policy-gradient losses: one entry point, `policy_loss`, over a registry of objectives.

Shapes: logprobs, gen_logprobs, old_logprobs, mask [num_samples, seq_len] (token log-probs of the taken tokens; mask
is 1/True on loss tokens); advantages, group_ids [num_samples]. Values outside the mask are ignored (may be anything).

The three policies:
    pi_train  `logprobs`      the trainer's current policy; the only input that carries gradient.
    pi_gen    `gen_logprobs`  the generator's own token log-probs, recorded at sampling time (the behaviour policy).
    pi_old    `old_logprobs`  PPO's "old" policy, the reference of the clipped ratio (ppo_clip, dapo, gspo) and the
                              numerator of tis_reinforce's weight. Default: pi_gen, i.e. the ratio is taken against the
                              policy that produced the tokens (PipelineRL: the generator's weights of that moment).
                              Pass the trainer's log-probs at the start of the optimizer step (computed without grad)
                              to clip against the trainer's own snapshot instead, as PPO-off-policy-k does.

Per-token objectives (rho = pi_train / pi_gen, r = pi_train / pi_old, A = the sample's advantage, sg = stop-gradient):
    cispo          sg(min(rho, eps_max)) * A * log pi_train                    (ScaleRL's loss; paper section 2)
    tis_reinforce  sg(min(pi_old / pi_gen, eps_max)) * A * log pi_train        REINFORCE on the generator's samples with
                   a truncated importance weight fixed for the step (it does not follow pi_train as CISPO's does).
                   With old_logprobs = gen_logprobs it is plain REINFORCE; with old_logprobs = logprobs.detach() it
                   equals cispo.
    ppo_clip       min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A), symmetric: clip_low must equal clip_high
    dapo           the same with clip-higher (clip_high > clip_low allowed, e.g. 0.2 / 0.26)
    gspo           min(s * A, clip(s, 1 - clip_low, 1 + clip_high) * A) on every token of the sample, with the
                   sequence ratio s = exp(mean_t log r_t) whose gradient flows through each token as
                   s * d log pi_t (GSPO-token form). With `sample` aggregation this is exactly GSPO's sequence loss
                   1/S * sum_i min(s_i A_i, clip(s_i) A_i).

The loss is -(sum over samples of w_i * sum_t objective_it), w_i from `aggregation` (see aggregation.py). Each
objective also gives its closed-form gradient d objective / d log pi_train, so backward stores one [S, T] tensor and
none of the intermediates (tests check it against autograd of the written formulas).

Metrics (0-dim detached tensors, over this call's loss tokens): clip_fraction (tokens whose ratio was clipped or
truncated, i.e. whose gradient the clip changed), ratio_mean / ratio_max (the loss's ratio: rho for cispo, pi_old/pi_gen
for tis_reinforce, r for ppo_clip/dapo, s for gspo), mismatch_k3 (mean of rho - 1 - log rho: the k3 estimate of
KL(pi_gen || pi_train), the train-vs-generator mismatch), tokens. Combine calls with `merge_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_scalerl.algo.aggregation import AGGREGATIONS, LossNormalizers
from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe.variants import LOSS_VARIANTS, Cispo, Dapo, Gspo, PpoClip, TisReinforce, Variant

# Tokens per chunk of rows in policy_loss: bounds the objectives' temporaries to a few MiB each, whatever the batch.
CHUNK_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class LossInputs:
    """Everything an objective reads, without gradient. [S, T] tensors are 0 outside the mask."""

    logprobs: torch.Tensor  # [S, T] log pi_train
    log_ratio_gen: torch.Tensor  # [S, T] log(pi_train / pi_gen)
    log_ratio_old: torch.Tensor  # [S, T] log(pi_train / pi_old)
    advantages: torch.Tensor  # [S, 1]
    mask: torch.Tensor  # [S, T] bool
    sample_tokens: torch.Tensor  # [S] loss tokens per sample


@dataclass(frozen=True)
class ObjectiveTerms:
    """An objective evaluated on a batch: per-sample sums of token objectives, its gradient, its ratio metrics."""

    objective_sums: torch.Tensor  # [S] sum_t objective_it over loss tokens
    grad: torch.Tensor  # [S, T] d objective_it / d log pi_train_it, 0 outside the mask; a fresh tensor
    clipped: torch.Tensor  # [S, T] bool, loss tokens whose ratio was clipped / truncated
    ratio: torch.Tensor  # [S, T] the loss's ratio on loss tokens, 0 elsewhere


def _truncated_is(inputs: LossInputs, log_weight: torch.Tensor, eps_max: float) -> ObjectiveTerms:
    """sg(min(exp(log_weight), eps_max)) * A * log pi_train."""
    ratio = torch.exp(log_weight).mul_(inputs.mask)
    clipped = ratio > eps_max
    grad = ratio.clamp(max=eps_max).mul_(inputs.advantages)
    return ObjectiveTerms(objective_sums=(grad * inputs.logprobs).sum(dim=-1), grad=grad, clipped=clipped, ratio=ratio)


def cispo(inputs: LossInputs, *, eps_max: float) -> ObjectiveTerms:
    return _truncated_is(inputs, inputs.log_ratio_gen, eps_max)


def tis_reinforce(inputs: LossInputs, *, eps_max: float) -> ObjectiveTerms:
    return _truncated_is(inputs, inputs.log_ratio_gen - inputs.log_ratio_old, eps_max)


def _clip_choice(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float):
    """min(ratio * A, clip(ratio) * A): (value, where the clipped constant was chosen)."""
    clipped = ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))
    value = torch.where(clipped, ratio.clamp(1 - clip_low, 1 + clip_high), ratio).mul_(advantages)
    return value, clipped


def _clipped_ratio(inputs: LossInputs, clip_low: float, clip_high: float) -> ObjectiveTerms:
    ratio = torch.exp(inputs.log_ratio_old).mul_(inputs.mask)
    value, clipped = _clip_choice(ratio, inputs.advantages, clip_low, clip_high)
    clipped &= inputs.mask
    # d(r A)/d log pi = r A where the ratio term is chosen; the clipped constant has no gradient.
    grad = (ratio * inputs.advantages).masked_fill_(clipped, 0.0)
    return ObjectiveTerms(objective_sums=value.mul_(inputs.mask).sum(dim=-1), grad=grad, clipped=clipped, ratio=ratio)


def ppo_clip(inputs: LossInputs, *, clip_low: float, clip_high: float) -> ObjectiveTerms:
    if clip_low != clip_high:
        raise UserError(f"loss ppo_clip is the symmetric clip but clip_low={clip_low} != clip_high={clip_high}; "
                        "use loss dapo for clip-higher")
    return _clipped_ratio(inputs, clip_low, clip_high)


def dapo(inputs: LossInputs, *, clip_low: float, clip_high: float) -> ObjectiveTerms:
    return _clipped_ratio(inputs, clip_low, clip_high)


def gspo(inputs: LossInputs, *, clip_low: float, clip_high: float) -> ObjectiveTerms:
    tokens = inputs.sample_tokens.to(inputs.log_ratio_old.dtype)
    seq_ratio = torch.exp(inputs.log_ratio_old.sum(dim=-1) / tokens.clamp(min=1)).unsqueeze(-1)  # [S, 1]
    value, seq_clipped = _clip_choice(seq_ratio, inputs.advantages, clip_low, clip_high)
    grad = (seq_ratio * inputs.advantages).masked_fill(seq_clipped, 0.0).mul(inputs.mask)
    return ObjectiveTerms(objective_sums=value.squeeze(-1) * tokens, grad=grad, clipped=seq_clipped & inputs.mask,
                          ratio=seq_ratio * inputs.mask)


# The objective of each of the recipe's losses (`algorithm.loss`, recipe/variants.py: its name and parameters).
OBJECTIVES: dict[type[Variant], Callable[..., ObjectiveTerms]] = {
    Cispo: cispo, TisReinforce: tis_reinforce, PpoClip: ppo_clip, Dapo: dapo, Gspo: gspo}
if set(OBJECTIVES) != set(LOSS_VARIANTS):  # every loss a recipe can name has its objective here
    raise ImportError(f"algo.losses has no objective for {sorted(c.tag() for c in set(LOSS_VARIANTS) - set(OBJECTIVES))}")
LOSSES: dict[str, type[Variant]] = {cls.tag(): cls for cls in OBJECTIVES}  # by name


def _loss(name: str) -> type[Variant]:
    if name not in LOSSES:
        raise UserError(f"unknown loss '{name}' (known: {', '.join(LOSSES)})")
    return LOSSES[name]


class _Linearised(torch.autograd.Function):
    """Returns a precomputed loss value; backward hands over the precomputed d loss / d logprobs.

    The gradient buffer is kept on ctx (not save_for_backward) and released in backward, so autograd can adopt it as
    logprobs.grad without a copy. Backward therefore runs once (retain_graph=True with a second backward is refused).
    """

    @staticmethod
    def forward(ctx, logprobs: torch.Tensor, value: torch.Tensor, grad_logprobs: torch.Tensor) -> torch.Tensor:
        ctx.grad_logprobs = grad_logprobs
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_logprobs = getattr(ctx, "grad_logprobs", None)
        if grad_logprobs is None:
            raise RuntimeError("policy_loss supports one backward pass per call")
        del ctx.grad_logprobs
        return grad_logprobs.mul_(grad_output), None, None


def _check_inputs(logprobs, gen_logprobs, old_logprobs, advantages, mask, group_ids) -> None:
    if logprobs.dim() != 2 or not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a float [num_samples, seq_len] tensor, got {tuple(logprobs.shape)} "
                         f"{logprobs.dtype}")
    for name, tensor in (("gen_logprobs", gen_logprobs), ("old_logprobs", old_logprobs), ("mask", mask)):
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(logprobs.shape)}")
    for name, tensor in (("advantages", advantages), ("group_ids", group_ids)):
        if tensor.shape != logprobs.shape[:1]:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected [num_samples] = "
                             f"[{logprobs.shape[0]}]")


def _chunk_inputs(rows: slice, logprobs, gen_logprobs, old_logprobs, advantages, mask, sample_tokens,
                  dtype: torch.dtype) -> LossInputs:
    mask = mask[rows]
    current = torch.where(mask, logprobs[rows].to(dtype), 0.0)
    log_ratio_gen = current - torch.where(mask, gen_logprobs[rows].to(dtype), 0.0)
    log_ratio_old = (log_ratio_gen if old_logprobs is None
                     else current - torch.where(mask, old_logprobs[rows].to(dtype), 0.0))
    return LossInputs(logprobs=current, log_ratio_gen=log_ratio_gen, log_ratio_old=log_ratio_old,
                      advantages=advantages[rows].to(dtype).unsqueeze(-1), mask=mask,
                      sample_tokens=sample_tokens[rows])


def policy_loss(name: str, *, logprobs: torch.Tensor, gen_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, group_ids: torch.Tensor, aggregation: str,
                old_logprobs: torch.Tensor | None = None, normalizers: LossNormalizers | None = None,
                **params: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to minimise (a 0-dim tensor, differentiable w.r.t. `logprobs`) and its metrics.

    `normalizers`: the counts of the whole optimizer step (LossNormalizers); None means this call IS the whole step.
    Pass the same normalizers to every DP rank and micro-batch of a step: the summed losses and gradients then equal
    those of one call over the full batch, so gradients must be SUMMED over ranks and micro-batches, not averaged
    (in Megatron: no 1/dp gradient scaling and no 1/num_microbatches loss scaling, as with calculate_per_token_loss).
    `params`: exactly the loss's parameters (the fields of its recipe section: `recipe.algorithm.loss.params()`).

    Memory: the objectives run on chunks of about CHUNK_ELEMENTS tokens (whole rows), writing one gradient buffer
    shaped like `logprobs`; that buffer becomes logprobs.grad. Nothing else outlives the call.
    """
    loss = _loss(name)
    if set(params) != loss.own_fields():
        raise UserError(f"loss {name} takes parameters {', '.join(sorted(loss.own_fields()))}; got "
                        f"{', '.join(params) or 'none'}")
    if aggregation not in AGGREGATIONS:
        raise UserError(f"unknown aggregation '{aggregation}' (known: {', '.join(AGGREGATIONS)})")
    _check_inputs(logprobs, gen_logprobs, old_logprobs, advantages, mask, group_ids)
    mask = mask.bool()
    num_samples, seq_len = logprobs.shape
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(seq_len, 1))
    chunks = [slice(start, start + rows_per_chunk) for start in range(0, num_samples, rows_per_chunk)]
    # Counted chunk by chunk: a row-wise count over the whole mask would allocate an int64 copy of it.
    sample_tokens = torch.cat([torch.count_nonzero(mask[rows], dim=-1) for rows in chunks] or
                              [torch.zeros(0, dtype=torch.int64, device=mask.device)])
    if normalizers is None:
        normalizers = LossNormalizers.from_sample_tokens(sample_tokens, group_ids)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    weights = normalizers.sample_weights(aggregation, sample_tokens, group_ids).to(logprobs.device, dtype)

    grad = torch.empty_like(logprobs, memory_format=torch.contiguous_format)
    value = torch.zeros((), dtype=dtype, device=logprobs.device)
    sums = _MetricSums(dtype, logprobs.device)
    with torch.no_grad():
        for rows in chunks:
            inputs = _chunk_inputs(rows, logprobs.detach(), gen_logprobs, old_logprobs, advantages.detach(), mask,
                                   sample_tokens, dtype)
            terms = OBJECTIVES[loss](inputs, **params)
            value -= (weights[rows] * terms.objective_sums).sum()
            grad[rows] = terms.grad.mul_(-weights[rows].unsqueeze(-1))
            sums.add(terms, inputs.log_ratio_gen, inputs.mask)
    return _Linearised.apply(logprobs, value.to(logprobs.dtype), grad), sums.metrics()


class _MetricSums:
    """Running sums of the metrics over chunks (0-dim tensors, no host sync until the caller reads them)."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.clipped, self.ratio_sum, self.ratio_max, self.mismatch = (
            torch.zeros((), dtype=dtype, device=device) for _ in range(4))

    def add(self, terms: ObjectiveTerms, log_ratio_gen: torch.Tensor, mask: torch.Tensor) -> None:
        self.tokens += torch.count_nonzero(mask)
        self.clipped += torch.count_nonzero(terms.clipped)
        self.ratio_sum += terms.ratio.sum()
        if terms.ratio.numel():
            self.ratio_max = torch.maximum(self.ratio_max, terms.ratio.max())
        # k3 = rho - 1 - log rho; 0 outside the mask, where the log ratio is 0.
        self.mismatch += torch.expm1(log_ratio_gen).sub_(log_ratio_gen).sum()

    def metrics(self) -> dict[str, torch.Tensor]:
        per_token = self.tokens.clamp(min=1).to(self.ratio_sum.dtype)
        return {"clip_fraction": self.clipped / per_token, "ratio_mean": self.ratio_sum / per_token,
                "ratio_max": self.ratio_max, "mismatch_k3": self.mismatch / per_token, "tokens": self.tokens}


def merge_metrics(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Combine the metrics of several calls (micro-batches, ranks) as if from one: token-weighted means, max, sum."""
    tokens = sum(float(p["tokens"]) for p in parts)
    merged: dict[str, float] = {"tokens": tokens}
    for key in ("clip_fraction", "ratio_mean", "mismatch_k3"):
        merged[key] = sum(float(p[key]) * float(p["tokens"]) for p in parts) / max(tokens, 1.0)
    merged["ratio_max"] = max((float(p["ratio_max"]) for p in parts), default=0.0)
    return merged
