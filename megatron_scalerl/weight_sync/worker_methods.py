"""The weight-sync methods of our vLLM worker extension: what trainer rank 0 (`fleet_control.FleetControl`) and
`scalerl serve` call on every generator worker through `POST /collective_rpc` (dev mode).

`WeightSyncWorkerMethods` is mixed into vLLM's worker with the rest of our plugin
(`inference.worker_extension.ScaleRLWorkerExtension`, whose module vLLM imports in every worker before it builds the
weight-transfer engine); importing this module registers our receiver (`receiver.ScaleRLWeightTransferEngine`) as
weight-transfer backend "scalerl" (and "gloo", its old name). The methods are prefixed `scalerl_`, since a name the
worker already has is refused at start-up:

    scalerl_fp32_lm_head()       keep the LM head in FP32 (weights and logits) under a bf16/fp16 body, a tied one as
                                 an FP32 copy of the embedding (`fp32_head`); its checksum
    scalerl_staging_room()       bytes this worker can give to staging a sync (free device memory; on CPUs the
                                 host's available memory divided among this server's workers)
    scalerl_stage_weights(plan)  receive (plan: JSON) a sync in the background while generating (`receiver`)
    scalerl_close_update()       close an update session a dead trainer left open (called at every connect)
    scalerl_discard_staged()     drop a staged sync (its checksums disagreed, or a sender failed)
    scalerl_weight_checksums()   {slice key: checksum} of the slices the last sync received (when its plan asked)
"""

from __future__ import annotations

import json

import torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from megatron_scalerl.weight_sync.fp32_head import make_lm_head_fp32
from megatron_scalerl.weight_sync.protocol import host_available_bytes
from megatron_scalerl.weight_sync.receiver import ScaleRLWeightTransferEngine

# Servers get `{"backend": "scalerl"}` (`vllm_server.WEIGHT_TRANSFER_BACKEND`); "gloo" is the name it had before.
for _name in ("scalerl", "gloo"):
    try:
        WeightTransferEngineFactory.register_engine(
            _name, "megatron_scalerl.weight_sync.receiver", "ScaleRLWeightTransferEngine")
    except ValueError:  # registered already in this process
        pass


class WeightSyncWorkerMethods:
    """Mixed into vLLM's worker (`self` is the worker: `model_runner`, `weight_transfer_engine`)."""

    def scalerl_fp32_lm_head(self) -> dict | None:
        return make_lm_head_fp32(self.model_runner.get_model())

    def scalerl_staging_room(self) -> dict:
        """{"bytes": what this worker can stage a sync in}: free device memory on GPUs; on CPUs the host's
        available memory divided among this server's workers. (A dict: `/collective_rpc` turns numbers into
        strings.)"""
        if torch.cuda.is_available():
            return {"bytes": int(torch.cuda.mem_get_info()[0])}
        return {"bytes": (host_available_bytes() or 0) // max(1, self.vllm_config.parallel_config.world_size)}

    def scalerl_stage_weights(self, plan: str) -> None:
        """Receive the sync `plan` (JSON: `/collective_rpc` passes strings) describes in the background, into
        staging tensors (`receiver`)."""
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
