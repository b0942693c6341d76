"""The memory plan (`scalerl recipe show R --plan`) against what real Megatron models hold.

Oracles: the static parts (bf16 weights, FP32 main gradients, the distributed optimizer's Adam moments and master
copies) are the bytes of the tensors a real trainer allocates, per rank, at TP=1 and at TP=2 / EP=2 over two ranks;
the activations are the bytes autograd keeps in one forward of the tiny models (saved-tensor hooks; attention
"unfused" as on CPU), with and without full recomputation at TP=1, without it over two ranks (TP=2 with sequence
parallelism, expert TP 2 or 1 beside EP=2: the routed tokens each rank runs); recomputation changes no loss or
gradient; the parameter counts are the models' own and the released models' (Llama-3.1-8B, Scout, Qwen3-8B,
-30B-A3B, -235B-A22B, Moonlight-16B-A3B, DeepSeek-V3); the shipped presets fit 80 GiB GPUs (DeepSeek-V3's trainer
only); the plan command names the changes that would make a layout fit.
"""

import json
import subprocess
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_scalerl.models.mapping import padded_vocab_size
from megatron_scalerl.models.memory_advice import generator_changes, trainer_changes
from megatron_scalerl.models.memory_plan import (
    LOGPROB_CHUNK_TOKENS,
    NCCL_COMMUNICATOR_GIB,
    NCCL_PART,
    generator_plan,
    head_backward_bytes,
    kv_sequences,
    param_counts,
    trainer_plan,
    weight_sync_senders,
)
from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.recipe import load_recipe
from tests.trainer_utils import BF16, rl_batch, run_scenarios, tiny_recipe

SEQ, ROWS = 320, 2  # one micro-batch: ROWS rows of SEQ tokens (max_prompt_tokens + max_new_tokens = SEQ)
PLAN_SETTINGS = ("cluster.trainer_nodes=1", "rollout.max_prompt_tokens=16", f"rollout.max_new_tokens={SEQ - 16}")
# Llama-3, Llama-4, Qwen3, Qwen3-MoE, DeepSeek-V3 (multi-latent attention)
MODELS = ["tiny_dense", "tiny_moe", "tiny_qwen3", "tiny_qwen3_moe", "tiny_deepseek_v3"]
STEP_MODELS = ["tiny_dense", "tiny_moe", "tiny_qwen3_moe", "tiny_deepseek_v3"]  # trainer steps (~15 s each): dense,
# and each routing
HEAD_MODELS = ["tiny_dense", "tiny_qwen3"]  # an untied head and a tied one
HEAD_TOKENS = 128
# two ranks: name -> (model, layout); TP with sequence parallelism; expert TP follows tp unless given
SPLIT = {
    "tiny_dense/tp2": ("tiny_dense", {"tp": 2}),
    "tiny_moe/ep2": ("tiny_moe", {"ep": 2, "dp": 2}),
    "tiny_qwen3/tp2": ("tiny_qwen3", {"tp": 2}),
    "tiny_qwen3_moe/ep2": ("tiny_qwen3_moe", {"ep": 2, "dp": 2}),
    "tiny_qwen3_moe/tp2": ("tiny_qwen3_moe", {"tp": 2}),  # expert TP 2: each rank runs both ranks' routed tokens
    "tiny_qwen3_moe/tp2ep2": ("tiny_qwen3_moe", {"tp": 2, "ep": 2, "expert_tp": 1}),  # experts folded onto TP ranks
    "tiny_deepseek_v3/tp2": ("tiny_deepseek_v3", {"tp": 2}),  # MLA's down-projections and latent norms whole on both
}
SPLIT_ACTIVATIONS = ["tiny_qwen3/tp2", "tiny_qwen3_moe/tp2", "tiny_qwen3_moe/tp2ep2", "tiny_deepseek_v3/tp2"]


def _recipe(model, layout, recompute="none"):
    layout = dict(layout)
    extra = [f"parallelism.expert_tp={layout.pop('expert_tp')}"] if "expert_tp" in layout else []
    if layout.get("tp", 1) > 1:
        extra.append("parallelism.sequence_parallel=true")
    return tiny_recipe(model, **layout, mbs=ROWS,
                       extra=(*PLAN_SETTINGS, *BF16, f"parallelism.recompute={recompute}", *extra))


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


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes that the ops run under it allocate and that are still referenced (each new storage
    counted once, from the op that made it until its tensor is gone; views of an op's inputs are not new)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.storages.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (key := t.untyped_storage().data_ptr()) not in self.storages | inputs:
                nbytes = t.untyped_storage().nbytes()
                self.storages.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, key, nbytes)
        return out


def _head_backward_peak(rank, model):
    """The peak bytes the FP32 head's backward (trainer/logprobs.py) allocates for HEAD_TOKENS bf16 hidden states,
    on a real trainer's head weight (FP32: the recipe's `trainer.fp32_lm_head`)."""
    from megatron_scalerl.trainer.logprobs import token_logprobs
    from megatron_scalerl.trainer.setup import build_model_and_optimizer, head_weight

    recipe = _recipe(model, {})
    [chunk], _ = build_model_and_optimizer(recipe)
    weight = head_weight(chunk)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(HEAD_TOKENS, recipe.model.hidden_size, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, recipe.model.vocab_size, (HEAD_TOKENS,), generator=g)
    logprobs, _ = token_logprobs(hidden, weight, targets, vocab_size=recipe.model.vocab_size)
    with _LiveBytes() as live:
        grads = torch.autograd.grad(logprobs.sum(), [hidden, weight])
    assert grads[1].dtype == weight.dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    return live.peak


def _step(rank, run_dir, model, recompute):
    from megatron_scalerl.trainer.trainer import Trainer

    trainer = Trainer(run_dir, _recipe(model, {}, recompute))
    return [(m["train/loss"], m["train/grad_norm"]) for m in (trainer.train_step(rl_batch(s)) for s in (0, 1))]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    scenarios = {f"{model}/allocated": (_allocated, model, {}) for model in MODELS}
    scenarios.update({f"{model}/head_backward": (_head_backward_peak, model) for model in HEAD_MODELS})
    for model in MODELS:
        for recompute in ("none", "full"):
            scenarios[f"{model}/saved/{recompute}"] = (_saved_by_forward, model, {}, recompute)
            if model in STEP_MODELS:
                scenarios[f"{model}/step/{recompute}"] = (_step, tmp_path_factory.mktemp("run"), model, recompute)
    [results] = run_local_workers(run_scenarios, 1, scenarios, timeout_s=600)
    return results


@pytest.fixture(scope="module")
def two_ranks():
    scenarios = {f"{name}/allocated": (_allocated, model, layout) for name, (model, layout) in SPLIT.items()}
    for name in SPLIT_ACTIVATIONS:
        scenarios[f"{name}/saved"] = (_saved_by_forward, *SPLIT[name], "none")
    return run_local_workers(run_scenarios, 2, scenarios, timeout_s=600)


def _assert_static_parts(plan, allocated, what):
    """Within 2% (megatron pads its buffers to bucket boundaries)."""
    for part, measured in allocated.items():
        assert plan.parts[part] == pytest.approx(measured, rel=0.02), (what, part, plan.parts[part], measured)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.multiprocess
def test_static_parts_are_the_bytes_one_rank_allocates(one_rank, model):
    _assert_static_parts(trainer_plan(_recipe(model, {})), one_rank[f"{model}/allocated"], model)


@pytest.mark.parametrize("name", SPLIT)
@pytest.mark.multiprocess
def test_static_parts_are_the_bytes_each_rank_allocates_when_split(two_ranks, name):
    plan = trainer_plan(_recipe(*SPLIT[name]))
    for rank, results in enumerate(two_ranks):
        _assert_static_parts(plan, results[f"{name}/allocated"], f"{name} rank {rank}")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.multiprocess
def test_activations_are_what_autograd_keeps(one_rank, model):
    """The forward's part of the estimate (with full recomputation: the layer inputs; the recomputed layer's working
    set is backward's) against what autograd keeps, within 1% (the plan bounds Qwen3-MoE's router scores by every
    expert's where a softmax after the top-k keeps k: +0.2%)."""
    for recompute in ("none", "full"):
        plan = trainer_plan(_recipe(model, {}, recompute), kernels="torch")
        estimate = plan.parts["layer inputs (full recompute)" if recompute == "full" else "activations"]
        measured = one_rank[f"{model}/saved/{recompute}"]
        assert estimate == pytest.approx(measured, rel=0.01), (model, recompute, estimate, measured)
    assert one_rank[f"{model}/saved/full"] < one_rank[f"{model}/saved/none"] / 3


@pytest.mark.parametrize("name", SPLIT_ACTIVATIONS)
@pytest.mark.multiprocess
def test_activations_per_rank_when_split(two_ranks, name):
    """Per rank at TP2 (sequence parallelism): the ranks' mean within 1% (the plan assumes balanced routing; with
    EP each rank's experts get the tokens routed to them, so one rank keeps more than the other)."""
    estimate = trainer_plan(_recipe(*SPLIT[name]), kernels="torch").parts["activations"]
    measured = [results[f"{name}/saved"] for results in two_ranks]
    assert estimate == pytest.approx(sum(measured) / len(measured), rel=0.01), (name, estimate, measured)


@pytest.mark.parametrize("model", HEAD_MODELS)
@pytest.mark.multiprocess
def test_the_heads_backward_is_what_its_gradients_and_chunks_take(one_rank, model):
    """The last stage's head parts against the peak the head's backward allocates on a real trainer's head, at
    HEAD_TOKENS tokens (few enough that the gradients weigh as much as a chunk of logits): the FP32 gradients of the
    head weight and of the hidden states (with the latter's bf16 copy) and three chunks of FP32 logits bound it, and
    exceed it by less than a chunk (the backward keeps two: logits and their gradient); without the gradients, the
    plan would fall short of it."""
    recipe = _recipe(model, {})
    chunk = min(LOGPROB_CHUNK_TOKENS, HEAD_TOKENS) * padded_vocab_size(recipe.model.vocab_size, 1) * 4
    gradients = head_backward_bytes(recipe, HEAD_TOKENS, body_bytes=2, head_bytes=4)
    measured = one_rank[f"{model}/head_backward"]
    assert 3 * chunk < measured
    assert 3 * chunk + gradients - chunk <= measured <= 3 * chunk + gradients, (model, measured, chunk, gradients)
    tokens = ROWS * SEQ  # the plan's own micro-batch: the same formula
    plan = trainer_plan(recipe, kernels="torch")
    assert plan.parts["head backward (fp32 gradients)"] == head_backward_bytes(recipe, tokens, 2, 4)


@pytest.mark.parametrize("model", STEP_MODELS)
@pytest.mark.multiprocess
def test_full_recompute_changes_no_loss_or_gradient(one_rank, model):
    assert one_rank[f"{model}/step/full"] == one_rank[f"{model}/step/none"]


@pytest.mark.parametrize("model", MODELS)
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


def _activated(recipe) -> float:
    """Parameters one token runs through: all but the routed experts', and moe_router_topk / num_experts of those."""
    m, counts = recipe.model, param_counts(recipe)
    routed = sum(counts.experts_per_layer)
    return counts.total - routed + (routed * m.moe_router_topk / m.num_experts if m.is_moe else 0)


# the released Qwen3 models' sizes (their model cards): total and activated parameters
QWEN3_SIZES = {"qwen3_8b": (8.2e9, 8.2e9), "qwen3_30b_a3b": (30.5e9, 3.3e9), "qwen3_235b_a22b": (235e9, 22e9)}


@pytest.mark.parametrize("preset", QWEN3_SIZES)
def test_the_released_qwen3_presets_fit_80_gib_gpus(preset):
    """The plan counts the released models' parameters (to the model cards' precision) and the preset's layout fits
    80 GiB on both sides, the generator with room for a prompt's samples; the MoE presets need their recomputation."""
    recipe = load_recipe("scalerl", model_preset=preset)
    total, activated = QWEN3_SIZES[preset]
    assert param_counts(recipe).total == pytest.approx(total, rel=0.01)
    assert _activated(recipe) == pytest.approx(activated, rel=0.02)
    assert recipe.rollout.max_prompt_tokens + recipe.rollout.max_new_tokens == 16384
    assert trainer_plan(recipe).fits(80), preset
    if preset != "qwen3_235b_a22b":
        assert generator_plan(recipe).fits(80, 0.9), preset
        assert kv_sequences(recipe, 80) >= recipe.rollout.generations_per_prompt
    else:
        _assert_weight_sync_communicators_do_not_fit(recipe, senders=128)
    if recipe.model.is_moe:
        assert not trainer_plan(recipe, recompute=False).fits(80)


# the released DeepSeek-V3 family models' sizes (their model cards; Moonlight's rounded to 16B and 3B): total,
# activated parameters, and the tolerance of the cards' precision
DEEPSEEK_SIZES = {"moonlight_16b_a3b": (16e9, 3e9, 0.05), "deepseek_v3_671b": (671e9, 37e9, 0.02)}


@pytest.mark.parametrize("preset", DEEPSEEK_SIZES)
def test_the_released_deepseek_v3_presets(preset):
    """The plan counts the released models' parameters and the preset's trainer fits 80 GiB GPUs (at Moonlight's 8k
    context, at 16k tokens for DeepSeek-V3, which needs its recomputation). Moonlight's generator fits with room
    for a prompt's samples; DeepSeek-V3's does not at any layout within a node (~162 GiB per GPU at TP8) nor over two
    (TP16): the preset's servers span four nodes (TP32), the least that fits."""
    recipe = load_recipe("scalerl", model_preset=preset)
    total, activated, rel = DEEPSEEK_SIZES[preset]
    assert param_counts(recipe).total == pytest.approx(total, rel=0.01)
    assert _activated(recipe) == pytest.approx(activated, rel=rel)
    assert trainer_plan(recipe).fits(80), preset
    tokens = recipe.rollout.max_prompt_tokens + recipe.rollout.max_new_tokens
    if preset == "moonlight_16b_a3b":
        assert tokens == recipe.model.max_position_embeddings == 8192
        assert generator_plan(recipe).fits(80, 0.9) and kv_sequences(recipe, 80) >= recipe.rollout.generations_per_prompt
    else:
        assert tokens == 16384 and not trainer_plan(recipe, recompute=False).fits(80)
        assert recipe.generator_server_nodes == 4
        hosts = _assert_weight_sync_communicators_do_not_fit(recipe, senders=256)
        assert kv_sequences(hosts, 80) >= recipe.rollout.generations_per_prompt
        within_a_node = load_recipe("scalerl", ["parallelism.generator_tp=8", "weight_sync.transport=gloo"],
                                    model_preset=preset)
        assert generator_plan(within_a_node).total_gib == pytest.approx(162.4, abs=0.5)
        assert not generator_plan(load_recipe("scalerl", ["parallelism.generator_tp=16", "weight_sync.transport=gloo"],
                                              model_preset=preset)).fits(80, 0.9)
        assert [c.settings for c in generator_changes(within_a_node, 80)] == [("parallelism.generator_tp=32",)]


def _assert_weight_sync_communicators_do_not_fit(recipe, senders: int):
    """The MoE presets whose every expert-parallel rank sends (`senders` of them) give every generator GPU one NCCL
    communicator per sender: the model side fits, weight sync's communicators do not, and the plan names the way
    out that fits (weight sync through the hosts). Returns that recipe."""
    plan = generator_plan(recipe)
    assert weight_sync_senders(recipe) == senders
    assert plan.beside[NCCL_PART] == senders * NCCL_COMMUNICATOR_GIB * 2**30
    assert sum(plan.parts.values()) / 2**30 <= 80 * 0.9 < plan.total_gib
    [change] = generator_changes(recipe, 80)
    assert change.settings == ("weight_sync.transport=gloo",) and f"each of the {senders} sending" in change.why
    hosts = load_recipe("scalerl", ["weight_sync.transport=gloo"], model_preset=recipe.name.split("+")[1])
    assert NCCL_PART not in generator_plan(hosts).beside and generator_plan(hosts).fits(80, 0.9)
    assert generator_plan(hosts).total_gib == pytest.approx(change.total_gib)
    return hosts


def test_multi_latent_attention_caches_its_latent():
    """vLLM's MLA cache: kv_lora_rank + qk_rope_head_dim bf16 values per token and layer, whole on every TP rank."""
    recipe = load_recipe("scalerl", model_preset="deepseek_v3_671b")
    per_token = recipe.model.num_layers * (512 + 64) * 2
    assert generator_plan(recipe).parts["kv cache, one full-length sequence"] == 16384 * per_token


def test_plan_command_says_whether_the_layout_fits():
    def plan(*args):
        return subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "recipe", "show", "scalerl",
                               "--model", "llama4_scout_17b_16e", "--plan", "--json", *args],
                              capture_output=True, text=True, timeout=120)
    fits, too_small = plan(), plan("--gpu-gib", "40")
    assert fits.returncode == 0 and json.loads(fits.stdout)["fits"], fits.stderr
    assert too_small.returncode == 1 and not json.loads(too_small.stdout)["fits"]
    trainer = json.loads(fits.stdout)["plans"][0]
    assert trainer["total_gib"] == pytest.approx(sum(trainer["gib"].values())) and trainer["total_gib"] < 80


NOT_FITTING = {  # (model preset, --set settings, GPU GiB) where the trainer and the generator do not fit
    "30b_no_recompute_tp1": ("qwen3_30b_a3b", ["parallelism.recompute=none", "parallelism.generator_tp=1"], 64),
    "235b_40gib": ("qwen3_235b_a22b", ["weight_sync.transport=gloo"], 40),
}


@pytest.mark.parametrize("case", NOT_FITTING)
def test_plan_names_changes_after_which_the_layout_fits(case):
    """Each change the plan names, given to the recipe loader as `--set`s, validates and plans to what it said; the
    trainer's changes fit; a generator at a node's GPUs already (235B on 40 GiB) spans two nodes."""
    preset, settings, gpu_gib = NOT_FITTING[case]
    recipe = load_recipe("scalerl", settings, model_preset=preset)
    sides = [(trainer_changes(recipe, gpu_gib), trainer_plan, 1.0),
             (generator_changes(recipe, gpu_gib), generator_plan, 0.9)]
    for changes, plan, usable in sides:
        assert not plan(recipe).fits(gpu_gib, usable)
        for change in changes:
            changed = plan(load_recipe("scalerl", [*settings, *change.settings], model_preset=preset))
            assert changed.total_gib == pytest.approx(change.total_gib)
            assert change.fits and changed.fits(gpu_gib, usable), change
    trainer, generator = (changes for changes, _, _ in sides)
    assert trainer and generator
    if case == "235b_40gib":  # a node's 8 GPUs already: a server over two nodes
        assert generator[0].settings == ("parallelism.generator_tp=16",) and "spanning 2 nodes" in generator[0].why
    if case == "30b_no_recompute_tp1":  # the preset's own choices: recomputation, two GPUs per server
        assert trainer[0].settings == ("parallelism.recompute=full",)
        assert generator[0].settings == ("parallelism.generator_tp=2",)


def test_plan_command_prints_what_to_set():
    preset, settings, gpu_gib = NOT_FITTING["30b_no_recompute_tp1"]
    out = subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "recipe", "show", "scalerl", "--model", preset,
                          "--plan", "--gpu-gib", str(gpu_gib), *(f"--set={s}" for s in settings)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "DOES NOT FIT" in out.stdout and "to fit 64.0 GiB, any one of:" in out.stdout
    assert "--set parallelism.recompute=full" in out.stdout and "--set parallelism.generator_tp=2" in out.stdout
