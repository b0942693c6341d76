"""MoE routing replay (R3) in the trainer, and the routes' place in the TrainBatch contract.

Real components, fp32, gloo, with MoE layers interleaved (layers 1 and 3 of 4: the routes' MoE-layer index differs
from the layer index, and pipeline stage 1 holds only MoE layer 1), for each MoE family (`MODELS`): the tiny Llama-4
MoE (4 experts, top-1, a sigmoid of the chosen logit) and the tiny Qwen3-MoE (8 experts, top-2 softmax routing,
renormalised over the chosen two: megatron's top-k of the logits then a softmax over them, `moe_router_pre_softmax`
false), and that one with `norm_topk_prob` false (a softmax over all experts then the top-k: pre-softmax true).
- the oracle: transformers' model on the same weights, its routers forced to the given experts (their forward
  replaced, in this test only: tests/hf_routing.py); replaying deliberately random routes gives its log-probs, and
  they are far from the unforced model's;
- replaying the routes the trainer's routers choose themselves gives exactly the unreplayed log-probs; agreement 1;
- the order of the k experts within a token's routes does not matter: reversed, the replayed log-probs are equal
  bit for bit (megatron scatters the k weights into [tokens, experts]);
- EP=2, TP=2 (sequence parallel) and PP=2 with full recomputation and several micro-batches take the same replayed
  step as one process (loss, grad norm, agreement, log-probs);
- the gate gets a gradient under replay; replay on with a batch without routes is an error naming the field;
- TrainBatch keeps routes through encode / decode, and a batch without them as before; bad routes are named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_scalerl import recipe as rc
from megatron_scalerl.batches.train_batch import BatchError, TrainBatch, decode, encode, pack_routes
from megatron_scalerl.errors import RecipeError
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.trainer.microbatches import assign_to_ranks, build_microbatches
from megatron_scalerl.trainer.routing_replay import topk_sets_agree
from tests.hf_routing import routed
from tests.trainer_utils import FP32, rl_batch, run_scenarios, tiny_recipe

TOLERANCE = 1e-4  # the HF parity tests' (tests/test_models_parity.py)
INTERLEAVED = ("model.moe_layer_interval=2",)  # MoE layers 1 and 3
MOE_LAYERS, VOCAB = 2, 1024


@dataclasses.dataclass(frozen=True)
class Model:
    preset: str
    experts: int
    top_k: int
    extra: tuple[str, ...] = ()


MODELS = {
    "llama4": Model("tiny_moe", experts=4, top_k=1),
    "qwen3_moe": Model("tiny_qwen3_moe", experts=8, top_k=2),  # norm_topk_prob: megatron's pre-softmax false
    "qwen3_moe_unnormalised": Model("tiny_qwen3_moe", experts=8, top_k=2, extra=("model.norm_topk_prob=false",)),
}
EXPERTS = MODELS["llama4"].experts  # the tests of pieces without a model use the Llama-4 model's routes


def _recipe(model: Model, replay: bool, hf: str, **layout):
    return tiny_recipe(model.preset, hf=hf, extra=(*FP32, *INTERLEAVED, *model.extra,
                                                   f"algorithm.routing_replay={str(replay).lower()}",
                                                   *layout.pop("extra", ())), **layout)


def _batch(model: Model = MODELS["llama4"], seed: int = 0) -> TrainBatch:
    """8 samples of 12-39 tokens with random valid routes (uint8 [T, 2, top_k]: top_k distinct experts each)."""
    batch = rl_batch(seed, vocab=VOCAB, groups=2, per_group=4)
    g = torch.Generator().manual_seed(100 + seed)
    scores = torch.rand(batch.num_tokens, MOE_LAYERS, model.experts, generator=g)
    return dataclasses.replace(batch, routes=scores.argsort(dim=-1)[..., :model.top_k].to(torch.uint8))


@pytest.fixture(scope="module", params=list(MODELS))
def model(request) -> Model:
    return MODELS[request.param]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, model) -> str:
    config = _recipe(model, False, hf=None).model
    return str(save_random_hf_model(config, tmp_path_factory.mktemp("hf_moe"), seed=7, std=0.1))


# -- the trainer, in workers ------------------------------------------------------------------------------------------

def _own_routes(trainer, batch: TrainBatch) -> torch.Tensor:
    """The routes the trainer's routers choose themselves on `batch` (one micro-batch, one rank), uint8 [T, 2, k]
    (the k experts in increasing order), read from megatron's routing map with forward hooks during an unreplayed
    pass."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps = {}
    routers = [m for m in trainer.model[0].modules() if isinstance(m, TopKRouter)]
    hooks = [r.register_forward_hook(lambda m, _a, out: maps.__setitem__(m.layer_number, out[1])) for r in routers]
    try:
        trainer.forward_backward.logprobs(dataclasses.replace(batch, routes=None))
    finally:
        for hook in hooks:
            hook.remove()
    (mb,) = build_microbatches(batch, dp_rank=0, dp_size=1, micro_batch_size=16)
    rows, seq = mb.tokens.shape
    routes = torch.zeros_like(batch.routes)
    offsets = batch.offsets.tolist()
    k = batch.routes.shape[-1]
    for moe_index, layer_number in enumerate(sorted(maps)):
        routing_map = maps[layer_number].to(torch.int8)  # [tokens, experts], k ones a row
        chosen = routing_map.sort(dim=-1, descending=True, stable=True).indices[:, :k].view(seq, rows, k)
        chosen = chosen.transpose(0, 1)  # [rows, seq, k]
        for row, i in enumerate(assign_to_ranks(batch.lengths.tolist(), 1)[0]):
            n = offsets[i + 1] - offsets[i] - 1
            routes[offsets[i]:offsets[i] + n, moe_index] = chosen[row, :n].to(torch.uint8)
            routes[offsets[i] + n, moe_index] = chosen[row, n - 1]  # the last token: a copy (never an input)
    return routes


def _one_process(rank, run_dir, hf, model):
    """Replay on and off on one model (mbs 16: one micro-batch), all before its one optimizer step."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_scalerl.trainer.trainer import Trainer

    trainer = Trainer(run_dir, _recipe(model, True, hf, mbs=16))
    fb, batch = trainer.forward_backward, _batch(model)
    fb.routing.replay = False
    own = dataclasses.replace(batch, routes=_own_routes(trainer, batch))
    out = {"own_routes": own.routes}
    out["plain"] = fb.logprobs(dataclasses.replace(batch, routes=None))
    out["off_random_agreement"] = fb.gradients(batch)[1]["routing_agreement"]
    out["off_own_agreement"] = fb.gradients(own)[1]["routing_agreement"]
    fb.routing.replay = True
    out["replay_random"] = fb.logprobs(batch)
    out["replay_reversed"] = fb.logprobs(dataclasses.replace(batch, routes=batch.routes.flip(-1)))
    out["replay_own"] = fb.logprobs(own)
    out["on_own_agreement"] = fb.gradients(own)[1]["routing_agreement"]
    try:
        fb.logprobs(dataclasses.replace(batch, routes=None))
    except BatchError as exc:
        out["no_routes_error"] = str(exc)
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    fb.gradients(batch)
    gates = [m.weight for m in trainer.model[0].modules() if isinstance(m, TopKRouter)]
    out["gate_grad_norms"] = [float(w.main_grad.norm()) for w in gates]
    out["step"] = _step(trainer, batch)
    return out


def _step(trainer, batch):
    """The replayed log-probs, then one replayed optimizer step's figures."""
    logprobs = trainer.forward_backward.logprobs(batch)
    metrics = trainer.train_step(batch)
    return logprobs, {k: metrics[k] for k in ("train/loss", "train/grad_norm", "train/routing_agreement")}


def _layout(rank, run_dir, hf, model, layout):
    from megatron_scalerl.trainer.trainer import Trainer

    return _step(Trainer(run_dir, _recipe(model, True, hf, **layout)), _batch(model))


LAYOUTS = {
    "ep2": dict(dp=2, ep=2, mbs=2, extra=("parallelism.recompute=full",)),
    "tp2": dict(tp=2, mbs=2, extra=("parallelism.sequence_parallel=true",)),
    "pp2": dict(pp=2, mbs=2, extra=("parallelism.recompute=full",)),  # 4 micro-batches through 1F1B
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, hf_dir, model):
    run_dir = tmp_path_factory.mktemp("one")
    return run_local_workers(run_scenarios, 1, {"one": (_one_process, run_dir, hf_dir, model)},
                             timeout_s=600)[0]["one"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, hf_dir, model):
    runs = tmp_path_factory.mktemp("layouts")
    scenarios = {name: (_layout, runs / name, hf_dir, model, layout) for name, layout in LAYOUTS.items()}
    return run_local_workers(run_scenarios, 2, scenarios, timeout_s=600)


# -- the oracle: HF's model forced to the routes ----------------------------------------------------------------------

def _hf_logprobs(hf_dir: str, model: Model, batch: TrainBatch, routes: torch.Tensor | None) -> torch.Tensor:
    """HF's log-prob of every token of `batch` packed like input_ids (0 for each sample's first token); with
    `routes`, every MoE layer's router forced to them (scored as the HF router scores its chosen experts)."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    config = _recipe(model, False, hf=None).model
    out = torch.zeros(batch.num_tokens)
    offsets = batch.offsets.tolist()
    for i in range(batch.num_samples):
        start, end = offsets[i], offsets[i + 1]
        ids = batch.input_ids[start:end]
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if routes is not None:
                sample = routes[start:end].long()
                stack.enter_context(routed(hf, config, lambda moe_index, _logits, sample=sample: sample[:, moe_index]))
            logits = hf(ids[None]).logits[0, :-1]
        out[start + 1:end] = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
    return out


def test_replayed_random_routes_give_the_forced_hf_logprobs(one_process, hf_dir, model):
    batch = _batch(model)
    forced = _hf_logprobs(hf_dir, model, batch, batch.routes)
    unforced = _hf_logprobs(hf_dir, model, batch, None)
    assert (one_process["replay_random"] - forced).abs().max().item() <= TOLERANCE
    assert (one_process["plain"] - unforced).abs().max().item() <= TOLERANCE
    assert (forced - unforced).abs().max().item() > 100 * TOLERANCE  # the routes do change the log-probs


def test_replaying_the_routers_own_choice_changes_nothing(one_process, model):
    assert not torch.equal(one_process["own_routes"], _batch(model).routes)
    assert torch.equal(one_process["replay_own"], one_process["plain"])
    assert one_process["off_own_agreement"] == one_process["on_own_agreement"] == 1.0


def test_the_order_within_a_tokens_experts_does_not_matter(one_process):
    assert torch.equal(one_process["replay_reversed"], one_process["replay_random"])


def test_agreement_is_reported_without_replay(one_process, model):
    chance = 1 / math.comb(model.experts, model.top_k)  # a random set of k experts is the router's own set
    assert 0.4 * chance < one_process["off_random_agreement"] < 2 * chance, one_process["off_random_agreement"]


def test_the_gate_learns_through_the_replayed_experts_scores(one_process):
    assert len(one_process["gate_grad_norms"]) == MOE_LAYERS and min(one_process["gate_grad_norms"]) > 0


def test_replay_without_routes_is_an_error_naming_the_field(one_process):
    assert one_process["no_routes_error"].startswith("TrainBatch: routes: algorithm.routing_replay is on")


@pytest.mark.parametrize("model", ["llama4", "qwen3_moe"], indirect=True)
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.multiprocess
def test_layouts_replay_like_one_process(one_process, two_ranks, name):
    ref_logprobs, ref = one_process["step"]
    assert torch.equal(ref_logprobs, one_process["replay_random"])  # the step's log-probs are the replayed ones
    for logprobs, metrics in (ranks[name] for ranks in two_ranks):
        assert (logprobs - ref_logprobs).abs().max().item() <= TOLERANCE, name
        assert math.isclose(metrics["train/loss"], ref["train/loss"], rel_tol=1e-4, abs_tol=1e-7), name
        assert math.isclose(metrics["train/grad_norm"], ref["train/grad_norm"], rel_tol=1e-4), name
        assert metrics["train/routing_agreement"] == pytest.approx(ref["train/routing_agreement"], abs=0.01), name


# -- pieces on the CPU, no model ----------------------------------------------------------------------------------------

def test_topk_sets_ignore_order():
    own = torch.tensor([[0, 1], [2, 3], [1, 3]])
    target = torch.tensor([[1, 0], [2, 3], [1, 2]])
    assert topk_sets_agree(own, target).tolist() == [True, True, False]


@pytest.mark.parametrize("spec", [MODELS["llama4"], MODELS["qwen3_moe"]], ids=["top1", "top2"])
@pytest.mark.parametrize("sequence_parallel_pad", [1, 4])
def test_routes_are_packed_into_rows_like_the_input_tokens(sequence_parallel_pad, spec):
    batch = _batch(spec)
    offsets = batch.offsets.tolist()
    for dp_rank in range(2):
        for mb in build_microbatches(batch, dp_rank=dp_rank, dp_size=2, micro_batch_size=3,
                                     pad_multiple=sequence_parallel_pad):
            assert mb.routes.dtype == torch.uint8 and mb.routes.shape == (*mb.tokens.shape, MOE_LAYERS, spec.top_k)
            for row, i in enumerate(mb.sample_index.tolist()):
                n = int(mb.input_lengths[row])
                if i >= 0:
                    assert n == offsets[i + 1] - offsets[i] - 1
                    assert torch.equal(mb.routes[row, :n], batch.routes[offsets[i]:offsets[i + 1] - 1])
                assert mb.input_mask[row].sum() == n
                assert (mb.routes[row, n:] == torch.arange(spec.top_k)).all()  # padding: slot j to expert j


def test_microbatches_of_a_batch_without_routes_have_none():
    batch = rl_batch(0, vocab=VOCAB, groups=2, per_group=4)
    assert all(mb.routes is None for mb in build_microbatches(batch, dp_rank=0, dp_size=1, micro_batch_size=3))


@pytest.mark.parametrize("with_routes", [True, False])
def test_train_batch_round_trip(tmp_path, with_routes):
    batch = _batch() if with_routes else rl_batch(0, vocab=VOCAB, groups=2, per_group=4)
    path = tmp_path / "batch.safetensors"
    path.write_bytes(encode(batch))
    got, _ = decode(path)
    got.validate("decoded", VOCAB, num_experts=EXPERTS)
    for field in dataclasses.fields(TrainBatch):
        expected = getattr(batch, field.name)
        assert getattr(got, field.name) is None if expected is None else torch.equal(getattr(got, field.name), expected)
    assert (got.routes is not None) == with_routes
    if with_routes:
        start, end = batch.offsets[1], batch.offsets[2]
        assert got.routes.dtype == torch.uint8 and torch.equal(got.sample(1)["routes"], batch.routes[start:end])


@pytest.mark.parametrize(
    "routes, fragment",
    [
        (lambda r: r.long(), "dtype torch.int64, expected torch.uint8"),
        (lambda r: r[:-1], "207 entries for 208 tokens"),
        (lambda r: r[:, :, 0], "expected \\[tokens, n_moe_layers, top_k\\]"),
        (lambda r: r + EXPERTS, "expert id 7 outside \\[0, 4\\)"),
        (lambda r: torch.cat([r, (r + 1) % EXPERTS, r], dim=-1),
         "token 0, MoE layer 0: experts \\[(\\d), \\d, \\1\\], an id repeats"),
    ],
)
def test_bad_routes_are_named(routes, fragment):
    batch = _batch()
    bad = dataclasses.replace(batch, routes=routes(batch.routes))
    with pytest.raises(BatchError, match="src: routes: " + fragment):
        bad.validate("src", VOCAB, num_experts=EXPERTS)


def test_pack_routes_concatenates_per_sample_routes_or_names_the_sample():
    batch = _batch()
    per_sample = [batch.sample(i)["routes"] for i in range(batch.num_samples)]
    lengths = batch.lengths.tolist()
    assert torch.equal(pack_routes(per_sample, lengths), batch.routes)
    assert pack_routes([None] * len(lengths), lengths) is None
    with pytest.raises(BatchError, match="sample 2 has none"):
        pack_routes([*per_sample[:2], None, *per_sample[3:]], lengths)
    with pytest.raises(BatchError, match="sample 1: .* entries for"):
        pack_routes([per_sample[0], per_sample[1][:-1], *per_sample[2:]], lengths)


def test_recipe_key_presets_and_rule():
    assert rc.load_recipe("scalerl").algorithm.routing_replay is False  # the paper's recipe
    r3 = rc.load_recipe("scalerl_r3")
    assert r3.algorithm.routing_replay is True and r3.model.is_moe
    assert rc.load_recipe("scalerl", ["algorithm.routing_replay=true"], model_preset="tiny_moe").algorithm.routing_replay
    with pytest.raises(RecipeError, match="algorithm.routing_replay: needs an MoE model"):
        rc.load_recipe("scalerl", ["algorithm.routing_replay=true"], model_preset="tiny_dense")
