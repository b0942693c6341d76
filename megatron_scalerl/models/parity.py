"""Run our Megatron model at a parallel layout on the same tokens as Hugging Face transformers, and compare.

Used by `scalerl verify logits` and by the parity tests. One set of spawned CPU workers (gloo) can run several
layouts in turn (`run_layouts`): for each one every worker builds its shard, loads the HF weights through the
mapping, splits the batch over data-parallel ranks, runs megatron's pipeline schedule (forward, optionally backward
with megatron's DDP and optimizer for the grad norm), and gathers the vocab-parallel logits. The oracle is
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

from megatron_scalerl.recipe import ModelConfig, ParallelismConfig


@dataclass(frozen=True)
class Layout:
    """A trainer layout. `etp` (expert tensor parallelism) defaults to `tp`; TP > 1 runs sequence parallel."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def min_world_size(self) -> int:
        """The fewest processes that hold this layout (data parallelism fills the rest)."""
        return self.pp * math.lcm(self.tp, self.ep * self.expert_tp)

    def parallelism(self) -> ParallelismConfig:
        return ParallelismConfig(
            tp=self.tp, pp=self.pp, ep=self.ep, expert_tp=self.expert_tp, sequence_parallel=self.tp > 1
        )

    def __str__(self) -> str:
        etp = f"xETP{self.expert_tp}" if self.ep > 1 and self.etp is not None else ""
        return f"TP{self.tp}xPP{self.pp}xEP{self.ep}{etp}"


@dataclass
class LayoutResult:
    layout: str
    logits: Tensor  # [batch, seq, vocab], fp32, gathered over TP and DP
    loss: float  # mean cross-entropy over all tokens of the batch
    grad_norm: float | None  # global L2 norm of d(loss)/d(weights); None for forward-only runs


def hf_reference(hf_dir: str, input_ids: Tensor, labels: Tensor, *, with_grad: bool) -> LayoutResult:
    """HF transformers' logits, mean cross-entropy and gradient norm (fp32) on [batch, seq] tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train(with_grad)
    with torch.set_grad_enabled(with_grad):
        logits = model(input_ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    grad_norm = None
    if with_grad:
        loss.backward()
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        grad_norm = torch.cat(grads).norm().item()
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
    model_cfg: ModelConfig, layout: Layout, hf_state: Any, input_ids: Tensor, labels: Tensor, *, with_grad: bool,
    megatron_ckpt: str | None = None,
) -> LayoutResult | None:
    """Inside a worker of an initialised process group: build, load (the HF weights, or the trainer checkpoint
    `megatron_ckpt`), run; the result on one rank, else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_scalerl.models.provider import build_model
    from megatron_scalerl.models.weights import load_hf_state
    from megatron_scalerl.platform.distributed import current_device, initialize_model_parallel

    initialize_model_parallel(layout.tp, layout.pp, layout.ep, layout.expert_tp)
    try:
        model = build_model(model_cfg, layout.parallelism(), fp32_lm_head=True)
        if megatron_ckpt is None:
            load_hf_state(model, hf_state, model_cfg)
        else:
            from megatron_scalerl.trainer.state import load_model_weights

            load_model_weights(Path(megatron_ckpt), model)
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        if input_ids.shape[0] % dp_size:
            raise ValueError(f"{layout}: batch {input_ids.shape[0]} does not split over {dp_size} data-parallel ranks")
        device = current_device()
        ids, lbl = input_ids.chunk(dp_size)[dp_rank].to(device), labels.chunk(dp_size)[dp_rank].to(device)
        optimizer = None
        if with_grad:
            model = DistributedDataParallel(
                model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
            )
            model.config.finalize_model_grads_func = finalize_model_grads
            optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.0, clip_grad=1e9), [model])
        else:
            model.eval()
        with torch.set_grad_enabled(with_grad):
            out = _run_schedule(model, ids, lbl, forward_only=not with_grad)
        grad_norm = float(optimizer.step()[1]) if optimizer is not None else None
        if out is None:  # not the last pipeline stage
            return None
        logits = _gather(out["logits"], ps.get_tensor_model_parallel_group(), dim=-1)
        logits = logits[..., : model_cfg.vocab_size]  # the padded rows (models.mapping.padded_vocab_size) are not HF's
        logits = _gather(logits, ps.get_data_parallel_group(), dim=0)
        loss = _gather(out["loss"], ps.get_data_parallel_group(), dim=0).mean().item()
        if ps.get_tensor_model_parallel_rank() or dp_rank:
            return None
        return LayoutResult(str(layout), logits.cpu(), loss, grad_norm)
    finally:
        ps.destroy_model_parallel()


def run_layouts_worker(
    rank: int,
    model_cfg_json: str,
    hf_dir: str,
    layouts: list[Layout],
    input_ids: Tensor,
    labels: Tensor,
    with_grad: bool,
    megatron_ckpt: str | None = None,
) -> list[LayoutResult | None]:
    """`run_local_workers` entry: every layout in turn on the same process group."""
    from megatron_scalerl.models.hf_io import LazyHFState

    model_cfg = ModelConfig.model_validate_json(model_cfg_json)
    hf_state = LazyHFState(Path(hf_dir))
    return [run_layout(model_cfg, layout, hf_state, input_ids, labels, with_grad=with_grad,
                       megatron_ckpt=megatron_ckpt) for layout in layouts]


def run_layouts(
    model_cfg: ModelConfig,
    hf_dir: str,
    layouts: list[Layout],
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
    from megatron_scalerl.platform.local_workers import run_local_workers

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
            raise RuntimeError(f"{layout}: expected one rank to report results, got {len(found)}")
        results.append(found[0])
    return results
