"""The memory plan (`scalerl recipe show R --plan`) against what real Megatron models hold.

Oracles: the static parts (bf16 weights, FP32 main gradients, the distributed optimizer's Adam moments and master
copies) are the bytes of the tensors a real trainer allocates, per rank, at TP=1 and at TP=2 / EP=2 over two ranks;
the activations are the bytes autograd keeps in one forward of the tiny models (saved-tensor hooks; attention
"unfused" as on CPU), with and without full recomputation; recomputation changes no loss or gradient; the parameter
counts are the models' own; the shipped 8B and Scout presets fit 80 GiB GPUs.
"""

import json
import subprocess
import sys

import pytest
import torch

from megatron_scalerl.models.memory_plan import (
    generator_plan,
    kv_sequences,
    param_counts,
    trainer_plan,
)
from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.recipe import load_recipe
from tests.trainer_utils import BF16, rl_batch, run_scenarios, tiny_recipe

SEQ, ROWS = 320, 2  # one micro-batch: ROWS rows of SEQ tokens (max_prompt_tokens + max_new_tokens = SEQ)
PLAN_SETTINGS = ("cluster.trainer_nodes=1", "rollout.max_prompt_tokens=16", f"rollout.max_new_tokens={SEQ - 16}")


def _recipe(model, layout, recompute="none"):
    return tiny_recipe(model, **layout, mbs=ROWS, extra=(*PLAN_SETTINGS, *BF16, f"parallelism.recompute={recompute}"))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _allocated(rank, model, layout):
    """This rank's bytes of weights, main-gradient buffers and optimizer state of a freshly built trainer."""
    from megatron_scalerl.platform.megatron_optimizer import optimizer_parts
    from megatron_scalerl.trainer.setup import build_model_and_optimizer

    [chunk], optimizer = build_model_and_optimizer(_recipe(model, layout))
    moments, masters = 0, 0
    for part in optimizer_parts(optimizer):
        moments += _nbytes(v for state in part.optimizer.state.values() for k, v in state.items()
                           if k in ("exp_avg", "exp_avg_sq"))
        masters += _nbytes(p for group in part.shard_fp32_from_float16_groups for p in group)
    return {"weights": _nbytes(chunk.parameters()),
            "gradients (fp32)": _nbytes(b.grad_data for b in chunk.buffers + chunk.expert_parallel_buffers),
            "optimizer (distributed)": moments + masters}


def _saved_by_forward(rank, model, layout, recompute):
    """Bytes of the distinct storages autograd saves in one forward of a ROWS x SEQ micro-batch (parameters and
    integer index tensors excluded)."""
    from megatron_scalerl.trainer.setup import build_model_and_optimizer

    recipe = _recipe(model, layout, recompute)
    [chunk], _ = build_model_and_optimizer(recipe)
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        storage = t.untyped_storage()
        if t.is_floating_point() and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, recipe.model.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(ROWS, SEQ)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        chunk(tokens, positions, None)
    return sum(saved.values())


def _step(rank, run_dir, model, recompute):
    from megatron_scalerl.trainer.role import Trainer

    trainer = Trainer(run_dir, _recipe(model, {}, recompute))
    return [(m["train/loss"], m["train/grad_norm"]) for m in (trainer.train_step(rl_batch(s)) for s in (0, 1))]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    scenarios = {f"{model}/allocated": (_allocated, model, {}) for model in ("tiny_dense", "tiny_moe")}
    for model in ("tiny_dense", "tiny_moe"):
        for recompute in ("none", "full"):
            scenarios[f"{model}/saved/{recompute}"] = (_saved_by_forward, model, {}, recompute)
            scenarios[f"{model}/step/{recompute}"] = (_step, tmp_path_factory.mktemp("run"), model, recompute)
    [results] = run_local_workers(run_scenarios, 1, scenarios, timeout_s=600)
    return results


@pytest.fixture(scope="module")
def two_ranks():
    scenarios = {"tiny_dense/tp2": (_allocated, "tiny_dense", {"tp": 2}),
                 "tiny_moe/ep2": (_allocated, "tiny_moe", {"ep": 2, "dp": 2})}
    return run_local_workers(run_scenarios, 2, scenarios, timeout_s=600)


def _assert_static_parts(plan, allocated, what):
    """Within 2% (megatron pads its buffers to bucket boundaries)."""
    for part, measured in allocated.items():
        assert plan.parts[part] == pytest.approx(measured, rel=0.02), (what, part, plan.parts[part], measured)


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
def test_static_parts_are_the_bytes_one_rank_allocates(one_rank, model):
    _assert_static_parts(trainer_plan(_recipe(model, {})), one_rank[f"{model}/allocated"], model)


@pytest.mark.parametrize("name, model, layout", [("tiny_dense/tp2", "tiny_dense", {"tp": 2}),
                                                 ("tiny_moe/ep2", "tiny_moe", {"ep": 2, "dp": 2})])
def test_static_parts_are_the_bytes_each_rank_allocates_when_split(two_ranks, name, model, layout):
    plan = trainer_plan(_recipe(model, layout))
    for rank, results in enumerate(two_ranks):
        _assert_static_parts(plan, results[name], f"{name} rank {rank}")


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
def test_activations_are_what_autograd_keeps(one_rank, model):
    """The forward's part of the estimate (with full recomputation: the layer inputs; the recomputed layer's working
    set is backward's) against what autograd keeps, within 10%."""
    for recompute in ("none", "full"):
        plan = trainer_plan(_recipe(model, {}, recompute), kernels="torch")
        estimate = plan.parts["layer inputs (full recompute)" if recompute == "full" else "activations"]
        measured = one_rank[f"{model}/saved/{recompute}"]
        assert estimate == pytest.approx(measured, rel=0.10), (model, recompute, estimate, measured)
    assert one_rank[f"{model}/saved/full"] < one_rank[f"{model}/saved/none"] / 3


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
def test_full_recompute_changes_no_loss_or_gradient(one_rank, model):
    assert one_rank[f"{model}/step/full"] == one_rank[f"{model}/step/none"]


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
def test_parameter_counts_are_the_models_own(tmp_path, model):
    from safetensors.torch import load_file

    from megatron_scalerl.models.hf_io import save_random_hf_model

    recipe = load_recipe("scalerl", model_preset=model)
    path = save_random_hf_model(recipe.model, tmp_path, seed=0)
    hf_total = sum(t.numel() for file in path.glob("*.safetensors") for t in load_file(file).values())
    assert param_counts(recipe).total == hf_total


def test_the_shipped_presets_fit_80_gib_gpus():
    dense = load_recipe("scalerl", model_preset="llama3_8b")
    scout = load_recipe("scalerl", model_preset="llama4_scout_17b_16e")
    assert param_counts(dense).total == pytest.approx(8.03e9, rel=0.005)  # Llama-3.1-8B
    assert param_counts(scout).total == pytest.approx(107.8e9, rel=0.005)  # Llama-4 Scout, text model
    for recipe in (dense, scout):
        assert trainer_plan(recipe).fits(80) and generator_plan(recipe).fits(80, 0.9), recipe.name
        assert kv_sequences(recipe, 80) >= recipe.rollout.generations_per_prompt
    # without recomputation Scout's activations would not fit: the preset's choice is needed
    assert not trainer_plan(scout, recompute=False).fits(80)


def test_plan_command_says_whether_the_layout_fits():
    def plan(*args):
        return subprocess.run([sys.executable, "-m", "megatron_scalerl.cli", "recipe", "show", "scalerl",
                               "--model", "llama4_scout_17b_16e", "--plan", "--json", *args],
                              capture_output=True, text=True, timeout=120)
    fits, too_small = plan(), plan("--gpu-gib", "40")
    assert fits.returncode == 0 and json.loads(fits.stdout)["fits"], fits.stderr
    assert too_small.returncode == 1 and not json.loads(too_small.stdout)["fits"]
    trainer = json.loads(fits.stdout)["plans"][0]
    assert trainer["total_gib"] == pytest.approx(sum(trainer["gib"].values())) and trainer["total_gib"] < 80
