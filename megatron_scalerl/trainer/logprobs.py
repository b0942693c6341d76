"""FP32 log-probs (and entropy) of the taken tokens, vocab-parallel and chunked along the sequence.

The output projection is fused into the computation: for each chunk of `chunk_tokens` tokens the FP32 logits
[chunk, vocab/tp] are formed, reduced across the tensor-parallel group (max, sum-exp, target logit), and dropped.
Backward recomputes each chunk's logits. Peak memory therefore holds [chunk, vocab/tp] FP32 logits, never
[seq_len, vocab]; the naive path (`naive_token_logprobs`) materialises all of them and keeps them for backward.

Shapes: hidden [tokens, hidden] (any float dtype; the math is FP32), weight [padded_vocab/tp, hidden] (this rank's
vocab slice, rows tp_rank*P/tp ... (tp_rank+1)*P/tp - 1 of the padded vocabulary P as in Megatron's
VocabParallelEmbedding / ColumnParallelLinear), targets [tokens] global token ids < vocab_size. Returns
(logprobs [tokens] fp32, entropy [tokens] fp32).

Vocabulary padding (`models.mapping.padded_vocab_size`): the weight rows with global index >= vocab_size are not
tokens. They take no part in the max, the sum-exp or the entropy (exactly the softmax over the true vocabulary) and
get zero gradient; a rank whose whole slice is padding contributes nothing to the reductions.

Entropy is a metric: it carries no gradient. Log-probs are differentiable w.r.t. hidden and weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_scalerl.models.mapping import real_vocab_rows

DEFAULT_CHUNK_TOKENS = 1024


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _vocab_slice(weight: torch.Tensor, group: dist.ProcessGroup | None, vocab_size: int | None) -> tuple[int, int]:
    """(global index of this rank's first vocab row, how many of its rows are real tokens rather than padding)."""
    rank = dist.get_rank(group) if group is not None else 0
    start, rows = rank * weight.shape[0], weight.shape[0]
    return start, rows if vocab_size is None else real_vocab_rows(vocab_size, start, rows)


def _row_max(logits: torch.Tensor) -> torch.Tensor:
    """Max over the vocab dim of [c, v]; -inf where v is 0 (a slice that is all padding)."""
    if logits.shape[1] == 0:
        return logits.new_full(logits.shape[:1], float("-inf"))
    return logits.max(dim=-1).values


class _FusedTokenLogprobs(torch.autograd.Function):
    """Output projection + log-softmax + gather, chunked; saves only the per-token log-normaliser."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, group, logits_dtype, vocab_size):  # noqa: D417
        n = hidden.shape[0]
        vocab_start, v_real = _vocab_slice(weight, group, vocab_size)
        w = weight[:v_real].to(logits_dtype)  # [v_real, h]: the padding rows take no part
        local_targets = targets - vocab_start
        in_slice = (local_targets >= 0) & (local_targets < v_real)
        rows = torch.arange(n, device=hidden.device)
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        log_norm = torch.empty_like(logprobs)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logits = (hidden[start:end].to(logits_dtype) @ w.t()).float()  # [c, v_real]
            row_max = _all_reduce(_row_max(logits), dist.ReduceOp.MAX, group)
            logits -= row_max[:, None]
            exp = logits.exp()
            sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
            hit = in_slice[start:end]
            target = logits.new_zeros(end - start)
            target[hit] = logits[rows[: end - start][hit], local_targets[start:end][hit]]
            target = _all_reduce(target, dist.ReduceOp.SUM, group)
            weighted = _all_reduce((exp * logits).sum(dim=-1), dist.ReduceOp.SUM, group)
            log_sum = sum_exp.log()
            logprobs[start:end] = target - log_sum
            entropy[start:end] = log_sum - weighted / sum_exp  # H = log Z - E_p[logit], shifted by row_max
            log_norm[start:end] = row_max + log_sum
        ctx.save_for_backward(hidden, weight, local_targets, in_slice, log_norm)
        ctx.chunk_tokens, ctx.logits_dtype, ctx.v_real = chunk_tokens, logits_dtype, v_real
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, local_targets, in_slice, log_norm = ctx.saved_tensors
        w = weight[: ctx.v_real].to(ctx.logits_dtype)
        w32 = weight[: ctx.v_real].float()
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # padding rows stay 0
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, hidden.shape[0])
            h = hidden[start:end]
            g = grad_logprobs[start:end].float()
            # d logprob / d logits = onehot(target) - softmax; only the real rows of this rank's vocab slice.
            logits = (h.to(ctx.logits_dtype) @ w.t()).float()  # [c, v_real]
            grad_logits = (logits - log_norm[start:end, None]).exp_().mul_(-g[:, None])
            hit = in_slice[start:end]
            grad_logits[rows[: end - start][hit], local_targets[start:end][hit]] += g[hit]
            grad_hidden[start:end] = grad_logits @ w32  # partial over the vocab slice: reduced by the caller's mapping
            grad_weight[: ctx.v_real].addmm_(grad_logits.t(), h.float())  # in place: no [vocab, h] temporary
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    logits_dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of `targets` under softmax(hidden @ weight.T) over the first `vocab_size` vocab rows
    (the true vocabulary; None: every row of the weight is a token), in FP32.

    hidden: [s, b, h] Megatron layout (with sequence parallel: this rank's [s/tp, b, h] slice) or [tokens, h].
    weight: this rank's [padded_vocab/tp, h] slice of the LM head.
    targets: same leading shape as the full (gathered) hidden, global token ids. Returns tensors shaped like targets.
    `logits_dtype`: precision of the projection (FP32 for the FP32 LM head; bf16 reproduces a bf16 head; the
    softmax is FP32 either way).
    With tp_group of size > 1 the input is routed through Megatron's TP mappings so that the partial input
    gradients of the vocab slices are summed (all-reduce, or reduce-scatter under sequence parallelism).
    """
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        from megatron.core.tensor_parallel import mappings

        if sequence_parallel:
            hidden = mappings.gather_from_sequence_parallel_region(hidden, group=tp_group)
        else:
            hidden = mappings.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on tokens")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = _FusedTokenLogprobs.apply(flat_hidden, weight, targets.reshape(-1), chunk_tokens, tp_group,
                                                logits_dtype, vocab_size)
    return logprobs.view(targets.shape), entropy.view(targets.shape)


def naive_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference on one rank: full FP32 logits [tokens, vocab], log_softmax, gather. Used by tests and the bench."""
    logits = hidden.float() @ weight.float().t()
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy.detach()
