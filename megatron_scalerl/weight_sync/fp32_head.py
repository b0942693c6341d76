"""The FP32 LM head inside a vLLM worker (`worker_methods.scalerl_fp32_lm_head`): the head's weights and logits in
FP32 under a bf16/fp16 body, loaded from the FP32 tensor the trainer sends (`sender.wire_dtype`); a head tied to the
embedding becomes an FP32 copy fed by every load of the embedding (docs/design.md section 6)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from megatron_scalerl.weight_sync import WEIGHT_UPDATE_IN_PROGRESS
from megatron_scalerl.weight_sync.protocol import EMBEDDING, LM_HEAD, checksum, dtype_name
from megatron_scalerl.weight_sync.receiver import tied_to


class FP32HeadMethod(UnquantizedEmbeddingMethod):
    """The LM head's method with FP32 weights: logits [tokens, vocab / tp] = FP32(x) @ W^T, all in FP32."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing to prepare: the CPU path would pack the weight for a low-precision GEMM."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x.float(), layer.weight, None if bias is None else bias.float())


def make_lm_head_fp32(model: torch.nn.Module) -> dict | None:
    """Store `model.lm_head`'s weight [padded vocab / tp, hidden] in FP32 and compute its logits in FP32.

    Returns None on a worker without the head (pipeline stage), else {"converted_from": the previous dtype, or None
    if it was FP32 already, "checksum": `protocol.checksum` of this worker's head weight}. Reloads keep it FP32:
    the layer's reload metadata (vLLM's layered reload materialises layers from it) is re-recorded.

    A head tied to the embedding (`tie_word_embeddings`: vLLM serves the embedding's weight as the head) gets an
    FP32 copy of its own, and every later load of the embedding (`protocol.EMBEDDING`, which the trainer sends in
    FP32) fills both: `_feed_head_from_embedding`. The embedding keeps the serving dtype, as the compiled forward
    and its CUDA graphs, captured at start-up, hold its storage; its lookups are the serving-dtype rounding of the
    FP32 weight, exactly what the trainer's FP32 embedding casts its lookups to (docs/design.md, "Precision").
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import capture_layer_to_meta

    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None:
        return None
    if weight.is_meta:  # inside a weight update (layered reload): the layer has no data until it finishes
        raise RuntimeError(f"{WEIGHT_UPDATE_IN_PROGRESS}: call again once it finished")
    if weight.dtype == torch.float32:
        return {"converted_from": None, "checksum": checksum(weight)}
    tied = tied_to(model, weight)
    if tied and tied != [EMBEDDING]:
        raise RuntimeError(f"fp32_lm_head: the LM head is tied to {tied}, not to {EMBEDDING}: the weight updates "
                           "would not reach its FP32 copy")
    fp32 = torch.nn.Parameter(weight.data.float(), requires_grad=False)
    fp32.__dict__.update(weight.__dict__)  # weight_loader, output_dim, ... (vLLM's loading attributes)
    fp32.weight_loader = head.weight_loader  # a tied weight's loader is the embedding's
    head.weight = fp32
    head.quant_method = FP32HeadMethod()
    get_layerwise_info(head).restore_metadata = capture_layer_to_meta(head)
    if tied:
        _feed_head_from_embedding(model, head)
    return {"converted_from": dtype_name(weight.dtype), "checksum": checksum(fp32)}


def _feed_head_from_embedding(model: torch.nn.Module, head: torch.nn.Module) -> None:
    """Make `model.load_weights` (what weight transfer engines and reloads from disk call with HF-named tensors) load
    `protocol.EMBEDDING` into `head`'s own weight too, through the head's weight loader (vLLM's layered reload
    wraps it while an update runs); the head's weight is then reported loaded as well."""
    load_weights = model.load_weights

    def load_weights_feeding_head(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        fed = []

        def tee() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == EMBEDDING:
                    head.weight.weight_loader(head.weight, tensor)
                    fed.append(name)
                yield name, tensor

        loaded = load_weights(tee())
        return loaded | {LM_HEAD} if fed else loaded

    model.load_weights = load_weights_feeding_head
