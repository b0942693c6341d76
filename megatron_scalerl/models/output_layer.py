"""The FP32 output layer (LM head): weights kept in FP32 and logits computed in FP32 from FP32 hidden states.

ScaleRL (following MiniMax-M1) computes the LM head in FP32 so the trainer's log-probs match the generator's; the
leave-one-out ablation `loo_no_fp32_head` turns it off, and then the head runs in the model dtype (bf16 logits).

`use_fp32_output_layer(model)` changes the class of the `ColumnParallelLinear` GPTModel built (it adds no state,
so the sharding, initialisation and tied-embedding wiring GPTModel set up stay exactly as they are) to
`FP32OutputLayer`, which
  - upcasts its input (and a tied embedding weight, if any) to FP32 before the matmul, and
  - keeps its own parameters FP32 when the model is cast (`model.bfloat16()`, megatron's `Float16Module`).
Logits stay vocab-parallel: each TP rank gets [s, b, vocab / tp] (the model is built with parallel_output=True).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from torch import Tensor


class FP32OutputLayer(ColumnParallelLinear):
    """ColumnParallelLinear that computes in FP32 and refuses dtype casts of its parameters."""

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):
        if weight is not None:  # tied embeddings: the shared weight may be bf16
            weight = weight.float()
        return super().forward(input_.float(), weight=weight, runtime_gather_output=runtime_gather_output)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True):  # noqa: ANN202
        def keep_fp32(tensor: Tensor) -> Tensor:
            moved = fn(tensor)
            if tensor.dtype == torch.float32 and moved.dtype != torch.float32:
                return tensor.to(device=moved.device)
            return moved

        return super()._apply(keep_fp32, recurse)


def use_fp32_output_layer(model: torch.nn.Module) -> None:
    """Turn `model.output_layer` (a GPTModel's) into an FP32 head in place; a no-op on stages without one."""
    layer = getattr(model, "output_layer", None)
    if layer is None:
        return
    if type(layer) is not ColumnParallelLinear:
        raise TypeError(f"expected GPTModel.output_layer to be a ColumnParallelLinear, got {type(layer).__name__}")
    layer.__class__ = FP32OutputLayer
    layer.float()
