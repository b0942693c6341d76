"""HF parity of the DeepSeek-V3 family (multi-latent attention, grouped sigmoid routing with the score-correction
bias, shared experts, dense first layers) at TP1, TP2, EP2, PP2 and TP2xEP2, and the bias kept bit for bit.

Oracle: transformers' DeepseekV3ForCausalLM with random weights (the routing bias drawn from U(-0.1, 0.1), norms from
U(0.5, 1.5)), fp32: logits (max abs diff <= 1e-4), mean cross-entropy and the gradient norm. Two models: "v3" as
DeepSeek-V3 (q through its low-rank projection, YaRN RoPE with mscale, 8 experts in 2 groups of which each token's
best one is used, top-2, one shared expert, the first layer dense) and "moonlight" as Moonlight (q projected
directly, plain RoPE, one group, top-3, two shared experts). The bias, the groups and YaRN each change HF's logits by
far more than our difference. Every layout exports its shards back to HF names bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.models.mapping import hf_parameter_names
from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.recipe import ModelConfig, load_recipe
from megatron_scalerl.verify.parity import hf_reference, trainer_layout
from tests.test_models_parity import _export_check, _merge_ranks

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-4
SEQ_LEN, BATCH, VOCAB = 48, 4, 263
MODELS = ("v3", "moonlight")
LAYOUTS = [trainer_layout(tp=2), trainer_layout(pp=2), trainer_layout(ep=2), trainer_layout(tp=2, ep=2)]


def _model_cfg(name: str) -> ModelConfig:
    base = load_recipe("scalerl", model_preset="tiny_deepseek_v3").model.model_dump()
    small = dict(vocab_size=VOCAB)
    if name == "moonlight":
        small.update(q_lora_rank=None, rope_scaling=None, n_group=1, topk_group=1, moe_router_topk=3,
                     n_shared_experts=2, routed_scaling_factor=2.446, rope_theta=50000.0)
    return ModelConfig.model_validate({**base, **small})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {name: str(save_random_hf_model(_model_cfg(name), root / name, seed=11, std=0.1)) for name in MODELS}


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return (torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator),
            torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator))


def _worker(rank, checkpoints, names, layouts):
    from megatron_scalerl.verify.parity import run_layout

    out = []
    for name in names:
        model_cfg = _model_cfg(name)
        out.append([(run_layout(model_cfg, layout, checkpoints[name], *_tokens(), with_grad=True),
                     _export_check(model_cfg, layout, checkpoints[name])) for layout in layouts])
    return out


def _run(checkpoints, names, layouts, world_size) -> dict[str, list]:
    per_rank = run_local_workers(_worker, world_size, checkpoints, names, layouts, timeout_s=900)
    return {name: _merge_ranks([r[index] for r in per_rank], len(layouts)) for index, name in enumerate(names)}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict:
    """transformers' fp32 logits, loss and gradient norm, per model (computed once for the module)."""
    return {name: hf_reference(checkpoints[name], *_tokens(), with_grad=True) for name in MODELS}


@pytest.fixture(scope="module")
def tp1(checkpoints) -> dict:
    """Per model: (the one-process result, HF names exported differently, exported, exported onto first ranks)."""
    return {name: results[0] for name, results in _run(checkpoints, MODELS, [trainer_layout()], 1).items()}


def _check(name, reference, results) -> None:
    for result, export_differing, names, first_names in results:
        where = f"{name} {result.layout}"
        assert (result.logits[..., :VOCAB] - reference.logits).abs().max().item() <= TOLERANCE, where
        assert result.loss == pytest.approx(reference.loss, rel=1e-5), where
        assert result.grad_norm == pytest.approx(reference.grad_norm, rel=1e-4), where
        assert not export_differing, where
        assert names == first_names == set(hf_parameter_names(_model_cfg(name))), where


@pytest.mark.parametrize("name", MODELS)
def test_tp1_matches_hf(name, references, tp1):
    _check(name, references[name], [tp1[name]])


def _hf_logits(checkpoint: str, edit=None, **change) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **change)
    if edit is not None:
        edit(hf)
    with torch.no_grad():
        return hf(_tokens()[0]).logits


def _no_routing_bias(hf) -> None:
    for layer in hf.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.e_score_correction_bias.zero_()


@pytest.mark.parametrize("edit, change", [
    (_no_routing_bias, {}),  # the score-correction bias is loaded and used for choosing
    (None, {"n_group": 1, "topk_group": 1}),  # the group limit is in effect
    (None, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),  # YaRN and its mscale
], ids=["bias", "groups", "yarn"])
def test_v3_features_matter(edit, change, checkpoints, tp1):
    changed = _hf_logits(checkpoints["v3"], edit, **change)
    assert (changed - tp1["v3"][0].logits[..., :VOCAB]).abs().max().item() > 100 * TOLERANCE


@pytest.mark.slow
def test_layouts_match_hf_and_each_other(checkpoints, references, tp1):
    """Both models at TP2 (sequence parallel), PP2, EP2 and TP2xEP2: HF's logits, loss and gradient norm, one
    process's loss, and every HF tensor exported back bit for bit (the round trip at TP2xEP2 included)."""
    for name, results in _run(checkpoints, MODELS, LAYOUTS, world_size=4).items():
        _check(name, references[name], results)
        single = tp1[name][0]
        for result, *_ in results:
            assert result.loss == pytest.approx(single.loss, rel=1e-6), f"{name} {result.layout}"
            assert result.grad_norm == pytest.approx(single.grad_norm, rel=1e-5), f"{name} {result.layout}"


def _bias_worker(rank, checkpoint):
    """A bf16 trainer model of `checkpoint`: its routers' bias dtype and whether it equals the checkpoint's, before and
    after an optimizer step."""
    from megatron_scalerl.models.hf_io import LazyHFState
    from megatron_scalerl.models.weights import export_hf_state, unwrap_model
    from megatron_scalerl.platform import initialize_model_parallel
    from megatron_scalerl.trainer.setup import build_model_chunks, build_optimizer
    from megatron_scalerl.verify.parity import _run_schedule, verify_recipe

    initialize_model_parallel()
    recipe = verify_recipe(_model_cfg("v3"), trainer_layout(), checkpoint)
    recipe = recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"precision": "bf16"})})
    (model,) = build_model_chunks(recipe, hidden_states_out=False)
    optimizer = build_optimizer(recipe, [model])
    hf = LazyHFState(__import__("pathlib").Path(checkpoint))

    def biases():
        return {name: tensor.clone() for name, tensor in export_hf_state(unwrap_model(model), recipe.model)
                if name.endswith("e_score_correction_bias")}

    before = biases()
    _run_schedule(model, *_tokens(), forward_only=False)
    optimizer.step()
    after = biases()
    return ({name: str(t.dtype) for name, t in before.items()},
            all(torch.equal(t, hf[name]) for name, t in before.items()),
            all(torch.equal(after[name], t) for name, t in before.items()))


def test_routing_bias_stays_fp32_and_untouched_by_training(checkpoints):
    """bf16 training (megatron's Float16Module casts buffers) keeps the checkpoint's FP32 bias bit for bit, and an
    optimizer step does not move it (megatron's bias update runs at rate 0)."""
    (result,) = run_local_workers(_bias_worker, 1, checkpoints["v3"], timeout_s=600)
    dtypes, loaded_exactly, unchanged = result
    assert dtypes and set(dtypes.values()) == {"torch.float32"}
    assert loaded_exactly and unchanged
