"""Tied input and output embeddings (`model.tie_word_embeddings`, the tiny_qwen3 preset) with the FP32 head in a bf16
trainer (the GPU recipe's precision, asked for on any CPU): the shared weight stays FP32 (loaded bit for bit from an
FP32 checkpoint whose values bf16 would round) while the body is bf16, and the logits are the FP32 product of the
hidden states with it; after an optimizer step at PP2 the first stage's embedding and the last stage's head are
still one FP32 tensor, bit for bit, moved by an FP32 update; the trainer's checkpoint exports it as one tensor,
`model.embed_tokens.weight` in FP32, and no `lm_head.weight`.

Oracles: the HF checkpoint's tensors, an FP32 matmul of the captured hidden states, the other pipeline stage.
"""

from __future__ import annotations

import pytest
import torch

from megatron_scalerl.models.convert import megatron_to_hf
from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.recipe import ParallelismConfig, load_recipe
from tests.trainer_utils import BF16, tiny_recipe

pytestmark = pytest.mark.multiprocess

EMBEDDING = "model.embed_tokens.weight"
MODEL = "tiny_qwen3"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """FP32 random weights, most of them not bf16-representable."""
    from megatron_scalerl.models.hf_io import save_random_hf_model

    return str(save_random_hf_model(load_recipe("scalerl", model_preset=MODEL).model,
                                    tmp_path_factory.mktemp("tied") / "hf", seed=3))


def _bf16_model_checks(rank: int, hf_dir: str) -> dict:
    """build_model(bf16, FP32 head) in megatron's Float16Module, loaded from `hf_dir`: dtypes, and the logits against
    FP32 and bf16 products of the hidden states the head received."""
    from pathlib import Path

    from megatron.core.transformer.module import Float16Module

    from megatron_scalerl.models import build_model, load_hf_state
    from megatron_scalerl.models.hf_io import LazyHFState
    from megatron_scalerl.platform import initialize_model_parallel

    model_cfg = load_recipe("scalerl", model_preset=MODEL).model
    initialize_model_parallel(seed=5)
    hf = LazyHFState(Path(hf_dir))
    model = build_model(model_cfg, ParallelismConfig(), fp32_lm_head=True, params_dtype=torch.bfloat16)
    load_hf_state(model, hf, model_cfg)
    wrapped = Float16Module(model.config, model)  # how the trainer runs bf16: casts the whole model
    shared = model.embedding.word_embeddings.weight
    captured = {}
    model.output_layer.register_forward_pre_hook(lambda _m, args: captured.setdefault("hidden", args[0]))
    ids = torch.randint(0, model_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = wrapped(ids, torch.arange(16).expand(2, 16), None, fp32_output=False).transpose(0, 1)
        hidden = captured["hidden"].float()
        fp32_product = hidden @ shared.t()
        bf16_product = hidden @ shared.bfloat16().float().t()  # what a bf16 shared weight would give
    return {
        "shared_dtype": shared.dtype, "body_dtype": model.decoder.layers[0].mlp.linear_fc1.weight.dtype,
        "hidden_dtype": captured["hidden"].dtype, "logits_dtype": logits.dtype,
        "shared_is_the_checkpoint": torch.equal(shared[:model_cfg.vocab_size], hf[EMBEDDING]),
        "checkpoint_needs_fp32": not torch.equal(hf[EMBEDDING], hf[EMBEDDING].bfloat16().float()),
        "no_output_weight_of_its_own": model.output_layer.weight is None,  # GPTModel passes the shared one
        "diff_from_fp32_product": (logits - fp32_product).abs().max().item(),
        "diff_from_bf16_product": (logits - bf16_product).abs().max().item(),
    }


def test_bf16_model_keeps_the_shared_weight_fp32_and_computes_logits_from_it(checkpoint):
    (out,) = run_local_workers(_bf16_model_checks, 1, checkpoint, timeout_s=300)
    assert out["shared_dtype"] == torch.float32 and out["body_dtype"] == torch.bfloat16
    assert out["hidden_dtype"] == torch.bfloat16 and out["logits_dtype"] == torch.float32
    assert out["checkpoint_needs_fp32"] and out["shared_is_the_checkpoint"]  # not rounded through bf16
    assert out["no_output_weight_of_its_own"]
    assert out["diff_from_fp32_product"] < 1e-5
    assert out["diff_from_bf16_product"] > 100 * out["diff_from_fp32_product"]


def _train_at_pp2(rank: int, recipe_yaml: str, run_dir: str) -> dict:
    """One bf16 trainer step at PP2 and a checkpoint: this stage's copy of the shared weight before and after, and
    the trainer's own head weight (`head_weight`, what the fused log-probs use) on the last stage."""
    from megatron.core import parallel_state

    from megatron_scalerl.models.weights import unwrap_model
    from megatron_scalerl.trainer.setup import head_weight
    from megatron_scalerl.trainer.trainer import Trainer
    from tests.trainer_utils import rl_batch

    recipe = load_recipe(recipe_yaml)
    trainer = Trainer(run_dir, recipe)
    gpt = unwrap_model(trainer.model[0])
    first = parallel_state.is_pipeline_first_stage()
    weight = gpt.embedding.word_embeddings.weight if first else gpt.output_layer.weight
    before = weight.detach().clone()
    trainer.train_step(rl_batch(0, vocab=recipe.model.vocab_size))
    trainer.checkpoint()
    return {"first": first, "dtype": weight.dtype, "before": before, "after": weight.detach().clone(),
            "body_dtype": gpt.decoder.layers[0].mlp.linear_fc1.weight.dtype,
            "head_is_it": first or head_weight(trainer.model[0]) is weight}


@pytest.mark.slow
def test_tie_holds_after_a_bf16_step_at_pp2_and_exports_as_one_fp32_tensor(checkpoint, tmp_path):
    from safetensors.torch import load_file

    from megatron_scalerl.fileio import dump_yaml

    recipe = tiny_recipe(MODEL, pp=2, hf=checkpoint, extra=BF16)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text(dump_yaml(recipe.model_dump(mode="json")))
    first, last = sorted(run_local_workers(_train_at_pp2, 2, str(run_dir / "recipe.yaml"), str(run_dir),
                                           timeout_s=600), key=lambda stage: not stage["first"])
    assert first["first"] and not last["first"] and last["head_is_it"]
    assert first["dtype"] == last["dtype"] == torch.float32 and first["body_dtype"] == torch.bfloat16
    assert torch.equal(first["before"], last["before"])  # the last stage's copy starts as the embedding
    assert torch.equal(first["after"], last["after"])  # one tensor after the step: gradients summed over stages
    moved = first["after"] != first["before"]
    assert moved.any() and not torch.equal(first["after"][moved], first["after"][moved].bfloat16().float())

    out = megatron_to_hf(run_dir / "checkpoints" / "iter_0000001", tmp_path / "hf", ParallelismConfig())
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert "lm_head.weight" not in exported
    assert exported[EMBEDDING].dtype == torch.float32
    assert torch.equal(exported[EMBEDDING], first["after"][:recipe.model.vocab_size])
    assert exported["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16  # the body
