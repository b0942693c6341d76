"""The output layer (LM head) as ScaleRL runs it: one class, `OutputLayer`, set up in one place (`build_model`).

GPTModel builds a `ColumnParallelLinear`; `adopt_output_layer` changes its class to `OutputLayer` (it adds no
parameters, so the sharding, initialisation and tied-embedding wiring GPTModel set up stay exactly as they are) and
gives it three settings:
  - `fp32` (the recipe's `trainer.fp32_lm_head`, after MiniMax-M1): the weights stay FP32 when the model is cast
    (`model.bfloat16()`, megatron's `Float16Module`) and logits are computed in FP32 from FP32 hidden states. Off
    (the `loo_no_fp32_head` ablation): the head runs in the model dtype.
  - `vocab_size`: the layer has `mapping.padded_vocab_size` rows; the logit columns past the true vocabulary are
    -inf, so every softmax over the logits (megatron's vocab-parallel cross-entropy, the parity check) is over the
    true vocabulary and the padding rows get no gradient.
  - `returns_hidden` (set by the trainer): forward returns its input, the hidden states [s(/tp), b, h], so GPTModel
    returns those instead of logits; the trainer fuses the head into its chunked log-prob op
    (`trainer.logprobs.token_logprobs`, which applies the same FP32 and padding rules to `layer.weight`).
Logits stay vocab-parallel: each TP rank gets [s, b, padded_vocab / tp] (the model is built with parallel_output=True).

Tied embeddings (`model.tie_word_embeddings`) with the FP32 head: the head's weight is the word embedding's (on one
stage the same parameter; on a pipeline's last stage a copy that megatron keeps equal, `mapping.TIED_OUTPUT_LAYER`),
so `adopt_tied_embedding` makes the embedding an `FP32TiedEmbedding`: its weight stays FP32 through every cast as the
head's does, and its lookups [s, b, h] are cast to the dtype the rest of the model computes in before the first
layer. Rounding commutes with the row lookup, so the body sees exactly what a bf16 embedding would give it, while
the head, the optimizer's update of the shared weight and every export keep FP32 (docs/design.md, "Precision").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from torch import Tensor

from megatron_scalerl.models.mapping import real_vocab_rows


class OutputLayer(ColumnParallelLinear):
    """ColumnParallelLinear with the FP32 head, the vocabulary-padding mask and the trainer's hidden-state mode."""

    fp32: bool
    vocab_size: int  # the true vocabulary; rows from here on are padding
    returns_hidden: bool

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):
        if self.returns_hidden:
            return input_, None
        if self.fp32:
            input_ = input_.float()
            if weight is not None and weight.dtype != torch.float32:
                raise RuntimeError(f"FP32 head: the tied embedding is {weight.dtype}; build the model with "
                                   "models.build_model, which keeps it FP32 (adopt_tied_embedding)")
        logits, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        rows = self.output_size_per_partition
        real = real_vocab_rows(self.vocab_size, parallel_state.get_tensor_model_parallel_rank() * rows, rows)
        if real < rows:
            logits = logits.masked_fill(torch.arange(rows, device=logits.device) >= real, float("-inf"))
        return logits, bias

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True):  # noqa: ANN202
        return super()._apply(_keep_fp32(fn) if self.fp32 else fn, recurse)


class FP32TiedEmbedding(VocabParallelEmbedding):
    """The word embedding of a tied model with the FP32 head: an FP32 weight [padded_vocab / tp, h] that module
    casts leave FP32, and lookups cast to `output_dtype`, the dtype the model was last cast to (tracked in `_apply`)."""

    output_dtype: torch.dtype

    def forward(self, input_: Tensor) -> Tensor:
        return super().forward(input_).to(self.output_dtype)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True):  # noqa: ANN202
        self.output_dtype = fn(torch.empty(0, dtype=self.output_dtype)).dtype  # what the cast makes of the body
        return super()._apply(_keep_fp32(fn), recurse)


def _keep_fp32(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """`fn` (a module cast or move) that moves FP32 tensors without changing their dtype."""

    def keep_fp32(tensor: Tensor) -> Tensor:
        moved = fn(tensor)
        if tensor.dtype == torch.float32 and moved.dtype != torch.float32:
            return tensor.to(device=moved.device)
        return moved

    return keep_fp32


def adopt_output_layer(model: torch.nn.Module, *, fp32: bool, vocab_size: int) -> None:
    """Turn `model.output_layer` (a GPTModel's) into an `OutputLayer` in place; a no-op on stages without one."""
    layer = getattr(model, "output_layer", None)
    if layer is None:
        return
    if type(layer) is not ColumnParallelLinear:
        raise TypeError(f"expected GPTModel.output_layer to be a ColumnParallelLinear, got {type(layer).__name__}")
    layer.__class__ = OutputLayer
    layer.fp32, layer.vocab_size, layer.returns_hidden = fp32, vocab_size, False
    if fp32:
        layer.float()


def adopt_tied_embedding(model: torch.nn.Module, *, body_dtype: torch.dtype) -> None:
    """Turn `model.embedding.word_embeddings` (a tied GPTModel's, FP32 head) into an `FP32TiedEmbedding` in place:
    its weight made FP32 (the same parameter object), its lookups cast to `body_dtype`; a no-op on stages without
    the embedding."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return
    layer = embedding.word_embeddings
    if type(layer) is not VocabParallelEmbedding:
        raise TypeError(f"expected GPTModel.embedding.word_embeddings to be a VocabParallelEmbedding, got "
                        f"{type(layer).__name__}")
    layer.float()
    layer.__class__ = FP32TiedEmbedding
    layer.output_dtype = body_dtype
