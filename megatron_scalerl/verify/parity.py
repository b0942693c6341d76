"""Run our Megatron model at a parallel layout on the same tokens as Hugging Face transformers, and compare.

Used by `scalerl verify logits` and by the parity tests. One set of spawned CPU workers (gloo) can run several
layouts in turn (`run_layouts`): for each one every worker builds its shard through the trainer's own
`trainer.setup` (so what is verified is what trains), loads the HF weights through the mapping, splits the batch
over data-parallel ranks, runs megatron's pipeline schedule (forward, optionally backward with the trainer's DDP and
distributed optimizer for the grad norm), and gathers the vocab-parallel logits. The oracle is
`hf_reference`: the HF model itself (fp32), its mean cross-entropy loss and the gradient norm of that loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_scalerl.checkpoint.sharded import load_model_weights
from megatron_scalerl.models.hf_io import load_hf_causal_lm
from megatron_scalerl.platform.distributed import current_device, initialize_model_parallel
from megatron_scalerl.platform.local_workers import run_local_workers
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig, Recipe, load_recipe


def trainer_layout(tp: int = 1, pp: int = 1, ep: int = 1, expert_tp: int | None = None) -> ParallelismConfig:
    """A trainer layout to verify; TP > 1 runs sequence parallel, as the trainer's presets do."""
    return ParallelismConfig(tp=tp, pp=pp, ep=ep, expert_tp=expert_tp, sequence_parallel=tp > 1)


def verify_recipe(model_cfg: ModelConfig, parallelism: ParallelismConfig, hf_dir: str | None) -> Recipe:
    """The `scalerl` recipe around `model_cfg` at `parallelism`, in fp32 with the FP32 head, starting from the HF
    checkpoint `hf_dir` (None: random init, weights loaded afterwards). fp32, so that differences from HF are the
    model's, not bf16 rounding."""
    base = load_recipe("scalerl")
    trainer = base.trainer.model_copy(update={"precision": "fp32", "fp32_lm_head": True, "init_from": hf_dir})
    return base.model_copy(update={"model": model_cfg, "parallelism": parallelism, "trainer": trainer})


@dataclass
class LayoutResult:
    layout: str
    logits: Tensor  # [batch, seq, vocab], fp32, gathered over TP and DP
    loss: float  # mean cross-entropy over all tokens of the batch
    grad_norm: float | None  # global L2 norm of d(loss)/d(weights); None for forward-only runs


def hf_reference(hf_dir: str, input_ids: Tensor, labels: Tensor, *, with_grad: bool) -> LayoutResult:
    """HF transformers' logits, mean cross-entropy and gradient norm (fp32) on [batch, seq] tokens."""
    model = load_hf_causal_lm(hf_dir, dtype=torch.float32)
    model.train(with_grad)
    with torch.set_grad_enabled(with_grad):
        logits = model(input_ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    grad_norm = None
    if with_grad:
        loss.backward()
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        grad_norm = torch.cat(grads).double().norm().item()  # fp32 sums of a million squares drift by 1e-4
    return LayoutResult("hf", logits.detach(), loss.item(), grad_norm)


def _run_schedule(model: torch.nn.Module, input_ids: Tensor, labels: Tensor, *, forward_only: bool) -> dict | None:
    """One micro-batch through megatron's schedule; the last stage returns {"logits" [b,s,v/tp], "loss" [b,s]}."""
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = input_ids.shape
    positions = torch.arange(seq, device=input_ids.device).expand(batch, seq)

    def loss_func(logits: Tensor) -> tuple[Tensor, dict]:
        kept = logits.detach().clone()
        token_loss = tensor_parallel.vocab_parallel_cross_entropy(
            logits.transpose(0, 1).float().contiguous(), labels.t().contiguous()
        )
        loss = token_loss.mean()
        return loss, {"logits": kept, "loss": token_loss.detach().t()}

    def forward_step(_data_iterator: Any, chunk: torch.nn.Module) -> tuple[Tensor, Any]:
        return chunk(input_ids, positions, None), loss_func

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[model],
        num_microbatches=1,
        seq_length=seq,
        micro_batch_size=batch,
        forward_only=forward_only,
    )
    return outputs[0] if outputs else None


def _gather(tensor: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def run_layout(
    model_cfg: ModelConfig, parallelism: ParallelismConfig, hf_dir: str, input_ids: Tensor, labels: Tensor, *,
    with_grad: bool, megatron_ckpt: str | None = None,
) -> LayoutResult | None:
    """Inside a worker of an initialised process group: build the model (and, with `with_grad`, the optimizer) by the
    trainer's own `trainer.setup`, with the weights of `hf_dir` or of the trainer checkpoint `megatron_ckpt`, and run
    it; the result on one rank, else None."""
    from megatron.core import parallel_state as ps

    from megatron_scalerl.models.weights import unwrap_model  # deferred, as the next: megatron-core (workers only)
    from megatron_scalerl.trainer.setup import build_model_chunks, build_optimizer

    p = parallelism
    initialize_model_parallel(p.tp, p.pp, p.ep, p.expert_tp_size)
    try:
        recipe = verify_recipe(model_cfg, p, hf_dir if megatron_ckpt is None else None)
        (model,) = build_model_chunks(recipe, hidden_states_out=False)
        if megatron_ckpt is not None:
            load_model_weights(Path(megatron_ckpt), unwrap_model(model))
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        if input_ids.shape[0] % dp_size:
            raise ValueError(f"{p.label}: batch {input_ids.shape[0]} does not split over {dp_size} data-parallel ranks")
        device = current_device()
        ids, lbl = input_ids.chunk(dp_size)[dp_rank].to(device), labels.chunk(dp_size)[dp_rank].to(device)
        optimizer = build_optimizer(recipe, [model]) if with_grad else None
        model.train(with_grad)
        with torch.set_grad_enabled(with_grad):
            out = _run_schedule(model, ids, lbl, forward_only=not with_grad)
        grad_norm = float(optimizer.step()[1]) if optimizer is not None else None  # the norm before clipping
        if out is None:  # not the last pipeline stage
            return None
        logits = _gather(out["logits"], ps.get_tensor_model_parallel_group(), dim=-1)
        logits = logits[..., : model_cfg.vocab_size]  # the padded rows (models.mapping.padded_vocab_size) are not HF's
        logits = _gather(logits, ps.get_data_parallel_group(), dim=0)
        loss = _gather(out["loss"], ps.get_data_parallel_group(), dim=0).mean().item()
        if ps.get_tensor_model_parallel_rank() or dp_rank:
            return None
        return LayoutResult(p.label, logits.cpu(), loss, grad_norm)
    finally:
        ps.destroy_model_parallel()


def run_layouts_worker(
    rank: int,
    model_cfg_json: str,
    hf_dir: str,
    layouts: list[ParallelismConfig],
    input_ids: Tensor,
    labels: Tensor,
    with_grad: bool,
    megatron_ckpt: str | None = None,
) -> list[LayoutResult | None]:
    """`run_local_workers` entry: every layout in turn on the same process group."""
    model_cfg = ModelConfig.model_validate_json(model_cfg_json)
    return [run_layout(model_cfg, layout, hf_dir, input_ids, labels, with_grad=with_grad,
                       megatron_ckpt=megatron_ckpt) for layout in layouts]


def run_layouts(
    model_cfg: ModelConfig,
    hf_dir: str,
    layouts: list[ParallelismConfig],
    input_ids: Tensor,
    labels: Tensor,
    *,
    with_grad: bool,
    world_size: int | None = None,
    timeout_s: float = 900.0,
    megatron_ckpt: str | None = None,
) -> list[LayoutResult]:
    """Run each layout on `world_size` spawned workers (default: the fewest that hold all of them); the weights come
    from `hf_dir`, or from the trainer checkpoint `megatron_ckpt` when given."""
    world_size = world_size or math.lcm(*(layout.min_world_size() for layout in layouts))
    per_rank = run_local_workers(
        run_layouts_worker,
        world_size,
        model_cfg.model_dump_json(),
        str(hf_dir),
        layouts,
        input_ids,
        labels,
        with_grad,
        megatron_ckpt,
        backend="auto",  # gloo workers on CPU; one GPU per worker (nccl) on a GPU machine
        timeout_s=timeout_s,
    )
    results = []
    for index, layout in enumerate(layouts):
        found = [r[index] for r in per_rank if r[index] is not None]
        if len(found) != 1:
            raise RuntimeError(f"{layout.label}: expected one rank to report results, got {len(found)}")
        results.append(found[0])
    return results
