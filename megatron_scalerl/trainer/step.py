"""The math of one optimizer step: TrainBatch -> micro-batches -> Megatron forward/backward -> policy loss -> gradients.

`ForwardBackward` runs megatron-core's forward/backward schedule over this rank's micro-batches with the policy loss
(and, forward only, the current policy's log-probs); `grad_norm` and `clip_and_update` finish the step on the
optimizer; `lr_at` is the learning-rate schedule and `StepState` the count of steps that a checkpoint keeps. The
trainer (`trainer/trainer.Trainer.train_step`) puts them together.

Split invariance: every DP rank reads the whole TrainBatch, so each computes the step's `LossNormalizers` itself
(no communication) and every micro-batch's loss is its exact share of the full-batch loss. Megatron's schedules
divide each micro-batch loss by the number of micro-batches and DDP averages gradients over DP ranks; the loss we
hand back is multiplied by both, so the gradient that reaches the optimizer is the full-batch gradient, whatever the
DP size and micro-batch split.

On the last pipeline stage the model returns hidden states (the output layer is fused into the log-prob
computation, see `trainer/logprobs.py` and `models` for the head); the loss function turns them into FP32 token
log-probs, then `algo.policy_loss`.

MoE routing: a batch with `routes` has them replayed (`algorithm.routing_replay`) or compared with the router's own
choice around every micro-batch's forward pass (`trainer/routing_replay.py`); `gradients` reports the agreement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from megatron_scalerl.algo.aggregation import LossNormalizers
from megatron_scalerl.algo.losses import merge_metrics, policy_loss
from megatron_scalerl.batches.train_batch import TrainBatch
from megatron_scalerl.platform.distributed import all_gathered, current_device
from megatron_scalerl.platform.megatron_optimizer import optimizer_parts
from megatron_scalerl.platform.precision import trainer_dtype
from megatron_scalerl.recipe import Recipe, TrainerConfig
from megatron_scalerl.recipe.variants import CosineSchedule
from megatron_scalerl.trainer.logprobs import token_logprobs
from megatron_scalerl.trainer.microbatches import MicroBatch, build_microbatches
from megatron_scalerl.trainer.routing_replay import RoutingReplay
from megatron_scalerl.trainer.setup import head_weight


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


def lr_at(updates: int, trainer: TrainerConfig) -> float:
    """Learning rate for the update after `updates` successful ones (skipped non-finite steps do not count): linear
    warm-up over `trainer.warmup_steps` updates, then constant (`lr_schedule: constant`, the paper's) or a cosine
    from `trainer.lr` down to its `min_lr` at update `trainer.max_steps` (`lr_schedule: {type: cosine, min_lr}`)."""
    if updates + 1 < trainer.warmup_steps:
        return trainer.lr * (updates + 1) / trainer.warmup_steps
    schedule = trainer.lr_schedule
    if not isinstance(schedule, CosineSchedule):
        return trainer.lr
    peak = max(trainer.warmup_steps, 1)  # the update count at which the rate peaks (the last warm-up update's)
    progress = min(max(updates + 1 - peak, 0) / max(trainer.max_steps - peak, 1), 1.0)
    return schedule.min_lr + (trainer.lr - schedule.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class StepState:
    """What changes from step to step (saved in checkpoints as part of the RL state)."""

    step: int = 0  # optimizer steps attempted: the index of the next TrainBatch, and the policy's weight version
    updates: int = 0  # successful updates (skipped non-finite steps excluded): the LR warm-up's count
    consecutive_nonfinite: int = 0
    skipped_steps: list[int] = field(default_factory=list)

    def advance(self, updated: bool) -> None:
        """Count the step just taken: an update, or (`updated` False) a skipped non-finite step."""
        if updated:
            self.updates += 1
            self.consecutive_nonfinite = 0
        else:
            self.consecutive_nonfinite += 1
            self.skipped_steps.append(self.step)
        self.step += 1


class ForwardBackward:
    """Megatron's forward/backward schedule with the policy loss, for one model (a list of pipeline-stage chunks
    wrapped in Megatron DDP) at this rank's place in the layout."""

    def __init__(self, recipe: Recipe, model_chunks: list):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.recipe = recipe
        self.model = model_chunks
        self.schedule = get_forward_backward_func()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.device = current_device()
        self.sequence_parallel = recipe.parallelism.sequence_parallel and self.tp_size > 1
        # FP32 head: FP32 logits; without it the head computes in the model's precision (the ablation)
        self.logits_dtype = torch.float32 if recipe.trainer.fp32_lm_head else trainer_dtype(recipe)
        self.routing = RoutingReplay(model_chunks, replay=recipe.algorithm.routing_replay,
                                     sequence_parallel=self.sequence_parallel, tp_rank=self.tp_rank,
                                     tp_size=self.tp_size, device=self.device)

    def gradients(self, batch: TrainBatch) -> tuple[float, dict[str, float]]:
        """Collective. Backpropagate the policy loss of `batch` (the whole step's batch, identical on every rank):
        the full-batch gradient accumulates into the model's DDP grad buffers (zero them first). Returns the step's
        summed loss and the loss's metrics merged over micro-batches and ranks (every rank gets them), with
        `routing_agreement` for a batch with routes."""
        normalizers = LossNormalizers.from_sample_tokens(batch.loss_tokens_per_sample(), batch.group_ids)
        microbatches = self._microbatches(batch)
        scale = float(len(microbatches) * self.dp_size)
        outputs = self._run_schedule(batch, microbatches, partial(self._loss, normalizers, scale),
                                     forward_only=False)
        loss, merged = self._reduce_metrics(outputs)
        return loss, {**merged, **self.routing.figures()}

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The current policy's log-prob of every token of `batch`, packed like batch.input_ids [T] (FP32; 0 for
        each sample's first token). Collective; every rank gets the full tensor."""
        def collect(mb: MicroBatch, hidden: torch.Tensor):
            lp, _ = self._token_logprobs(mb, hidden)
            return lp.sum() * 0, {"logprobs": lp, "sample_index": mb.sample_index}

        for chunk in self.model:
            chunk.eval()
        try:
            outputs = self._run_schedule(batch, self._microbatches(batch), collect, forward_only=True)
        finally:
            for chunk in self.model:
                chunk.train()
        packed = torch.zeros(batch.num_tokens, dtype=torch.float32, device=self.device)
        offsets = batch.offsets.tolist()
        if self.tp_rank == 0:
            for out in outputs:
                for row, i in enumerate(out["sample_index"].tolist()):
                    if i >= 0:
                        n = offsets[i + 1] - offsets[i] - 1
                        packed[offsets[i] + 1:offsets[i + 1]] = out["logprobs"][row, :n]
        if dist.is_initialized():
            dist.all_reduce(packed)
        return packed.cpu()

    # -- the pieces ----------------------------------------------------------------------------------------------

    def _microbatches(self, batch: TrainBatch) -> list[MicroBatch]:
        pad = self.tp_size if self.sequence_parallel else 1
        return build_microbatches(batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                  micro_batch_size=self.recipe.parallelism.micro_batch_size, pad_multiple=pad)

    def _run_schedule(self, batch: TrainBatch, microbatches: list[MicroBatch], loss_fn, *,
                      forward_only: bool) -> list[dict]:
        """Megatron's schedule over `microbatches` (of `batch`); `loss_fn(mb, hidden)` -> (loss, metrics). Returns the
        metrics of every micro-batch (last pipeline stage only; empty elsewhere)."""
        self.routing.begin(batch)
        try:
            return self.schedule(
                forward_step_func=partial(self._forward_step, loss_fn), data_iterator=iter(microbatches),
                model=self.model, num_microbatches=len(microbatches),
                seq_length=max(mb.tokens.shape[1] for mb in microbatches),
                micro_batch_size=microbatches[0].tokens.shape[0], forward_only=forward_only)
        finally:
            self.routing.end()

    def _forward_step(self, loss_fn, data_iterator, model):
        mb: MicroBatch = next(data_iterator).to(self.device)
        self.routing.before_forward(mb)
        hidden = model(mb.tokens, mb.position_ids, None)
        self.routing.after_forward(mb)
        return hidden, partial(loss_fn, mb)

    def _loss(self, normalizers: LossNormalizers, scale: float, mb: MicroBatch, hidden: torch.Tensor):
        """hidden: [rows, seq(/tp), hidden] from the last stage. Returns (scaled loss, metrics of this micro-batch)."""
        lp, entropy = self._token_logprobs(mb, hidden)
        chosen = self.recipe.algorithm.loss
        loss, metrics = policy_loss(chosen.tag(), logprobs=lp, gen_logprobs=mb.gen_logprobs,
                                    advantages=mb.advantages, mask=mb.loss_mask, group_ids=mb.group_ids,
                                    aggregation=self.recipe.algorithm.aggregation, normalizers=normalizers,
                                    **chosen.params())
        metrics["loss"] = loss.detach()
        metrics["entropy_sum"] = (entropy * mb.loss_mask).sum()
        return loss * scale, metrics

    def _token_logprobs(self, mb: MicroBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [rows, seq(/tp), h] -> (log-probs, entropy) of mb.targets, each [rows, seq] FP32. The head weight
        [padded_vocab/tp, hidden] is the last stage's; its rows past `model.vocab_size` (padding) are masked out."""
        lp, entropy = token_logprobs(hidden.transpose(0, 1), head_weight(self.model[-1]), mb.targets.t(),
                                     tp_group=self.tp_group, sequence_parallel=self.sequence_parallel,
                                     logits_dtype=self.logits_dtype, vocab_size=self.recipe.model.vocab_size)
        return lp.t(), entropy.t()

    def _reduce_metrics(self, outputs: list[dict]) -> tuple[float, dict[str, float]]:
        """The step's summed loss and its metrics merged over micro-batches and ranks; every rank gets the result.

        Only last-stage ranks have outputs and their TP peers hold identical copies, so TP rank 0 contributes.
        """
        contributes = self.is_last_stage and (not dist.is_initialized() or self.tp_rank == 0)
        mine = outputs if contributes else []
        local = merge_metrics(mine)
        local["loss"] = sum(float(o["loss"]) for o in mine)
        local["entropy_sum"] = sum(float(o["entropy_sum"]) for o in mine)
        parts = all_gathered(local)
        merged = merge_metrics(parts)
        merged["entropy"] = sum(p["entropy_sum"] for p in parts) / max(merged["tokens"], 1.0)
        return sum(p["loss"] for p in parts), merged


def grad_norm(optimizer) -> float:
    """Global L2 norm of the step's gradients (after Megatron's DP reduction), before clipping."""
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm())


def clip_and_update(optimizer, norm: float, max_norm: float) -> bool:
    """Clip to `max_norm` (0: no clipping) with the norm already computed, then update (megatron's `step` minus the
    second norm computation). Returns whether the update happened."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if max_norm > 0:
        for part in optimizer_parts(optimizer):
            params = part.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=norm)
    return bool(optimizer.step_with_ready_grads())
