"""Fixes to megatron-core 0.16.1's distributed optimizer that every backend needs (GPU and CPU alike).

`prepare_optimizer(model_chunks, optimizer)` applies them, once, right after `get_megatron_optimizer` (the trainer's
`build_optimizer` is the one caller); each has its own test in tests/test_platform_megatron_optimizer.py.

  1. `fix_param_group_index_map`: with mixed parameter dtypes (bf16 body + FP32 LM head) the optimizer's
     `model_param_group_index_map` points at the wrong optimizer parameters. megatron records each parameter's
     (group, position) in grad-buffer order (the bf16 buffer, then the FP32 buffer holding the head) but then
     rebuilds every group's parameter list as [FP32 shards, FP32 copies of the bf16 shards]: every lookup is
     shifted, checkpoints fail to save (shape mismatch), and a load can silently swap the Adam moments of two
     equal-sized neighbours. The map is rebuilt from the group lists megatron actually handed to torch.
  2. `patch_torch_adam_checkpoint_load`: without Transformer Engine / Apex the optimizer is torch's Adam, whose
     per-parameter `step` a `fully_reshardable` checkpoint load does not carry (KeyError 'step').
  3. `materialise_optimizer_state`: torch's Adam creates its state lazily at the first step, but megatron describes
     an optimizer for a checkpoint (save, or what to load into) from its current state. A fresh optimizer gets
     its state here, at build time, on every rank (it runs a collective step), so checkpointing never has to
     decide anything and never touches a trained optimizer's moments.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_scalerl.platform.cpu_compat import require_megatron_attr


def optimizer_parts(optimizer: Any) -> list:
    """The megatron optimizers inside `optimizer` (a ChainedOptimizer holds one per parameter kind, e.g. experts)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


# 1. group index map -------------------------------------------------------------------------------------------


def fix_param_group_index_map(part: Any) -> None:
    """Point `model_param_group_index_map[param] = (group, order)` at `param`'s shard in the torch optimizer:
    `part.optimizer.param_groups[group]["params"][order]`, whose lists are [FP32 params, FP32-from-16-bit params]."""
    if not hasattr(part, "model_param_group_index_map"):  # not a DistributedOptimizer
        return
    index = {}
    for group, (fp32, float16) in enumerate(zip(part.model_fp32_groups, part.model_float16_groups, strict=True)):
        members = [*fp32, *float16]
        if len(members) != len(part.optimizer.param_groups[group]["params"]):
            raise RuntimeError(f"megatron-core changed: optimizer group {group} holds "
                               f"{len(part.optimizer.param_groups[group]['params'])} params, the model groups "
                               f"{len(members)}")
        for order, param in enumerate(members):
            index[param] = (group, order)
    if set(index) != set(part.model_param_group_index_map):
        raise RuntimeError("megatron-core changed: the optimizer's parameter groups do not cover its index map")
    part.model_param_group_index_map = index


# 2. torch Adam `step` on checkpoint load -----------------------------------------------------------------------


def patch_torch_adam_checkpoint_load() -> None:
    """Loading a `fully_reshardable` checkpoint, `_set_main_param_and_optimizer_states` copies every key of the
    parameter's optimizer state from the checkpoint tensors, which carry no `step` (load_state_dict restores it
    separately). The patched method keeps the restored step, as a tensor of its own per parameter:
    load_state_dict hands every parameter the same step tensor and torch's Adam increments each parameter's step
    in place, so a shared one would advance once per parameter and skew the bias correction. Idempotent."""
    from megatron.core.optimizer import distrib_optimizer

    cls = require_megatron_attr(distrib_optimizer, "DistributedOptimizer")
    original = require_megatron_attr(cls, "_set_main_param_and_optimizer_states")
    if getattr(original, "_scalerl_patched", False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):  # noqa: ANN001
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    _set_main_param_and_optimizer_states._scalerl_patched = True  # type: ignore[attr-defined]
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


# 3. state of a fresh optimizer ---------------------------------------------------------------------------------


def materialise_optimizer_state(model_chunks: list, optimizer: Any) -> None:
    """Collective (every rank, unconditionally). One step with zero gradients at learning rate 0 creates Adam's
    state without touching the weights; resetting the step count to 0 then makes it exactly a fresh optimizer's
    state (zero moments, no step taken). Call only on a new optimizer."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for part in optimizer_parts(optimizer):
        for param_state in part.optimizer.state.values():
            if "step" in param_state:
                param_state["step"].zero_()
        for group in part.optimizer.param_groups:  # Transformer Engine's FusedAdam counts steps per group
            if isinstance(group.get("step"), torch.Tensor):
                group["step"].zero_()
            elif "step" in group:
                group["step"] = 0


def prepare_optimizer(model_chunks: list, optimizer: Any) -> None:
    """Collective. Everything above, in order, on a newly built megatron optimizer."""
    for part in optimizer_parts(optimizer):
        fix_param_group_index_map(part)
    patch_torch_adam_checkpoint_load()
    materialise_optimizer_state(model_chunks, optimizer)
