"""Benchmark: `policy_loss` (vectorised, closed-form gradient) vs a naive reference, forward + backward, on CPU.

The batch is one ScaleRL optimizer step: 48 prompts x 16 samples = 768 samples x 16,384 tokens (float32 log-probs,
sample lengths uniform in [T/4, T]), prompt aggregation (the recipe's default). The naive reference is the textbook
code: a Python loop over prompts, each prompt's loss written with autograd from the formula, then averaged. Both
run on the same inputs in this process; the two must agree (loss and gradient) before anything is reported.

Time: median of --repeats forward + backward passes. Peak memory, two independent methods:
  torch  the peak of the bytes held by torch's CPU allocator during the pass above what was held before it (the
         inputs and the fresh leaf tensor of log-probs are allocated before),
         replayed from the torch profiler's allocation/free events (profile_memory=True): exact, every tensor the
         pass allocates (autograd's saved tensors, temporaries, the gradient), nothing else.
  rss    what the OS sees: each variant runs once more in a fresh child process; after a warm-up pass the kernel's
         peak-RSS counter is reset (/proc/self/clear_refs "5") and the child reports VmHWM - VmRSS before the pass.
(tracemalloc would see none of it: torch allocates outside Python's allocator.)

    python bench/losses.py [--small] [--losses cispo,gspo] [--repeats 3]
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_scalerl.algo.losses import LOSSES, policy_loss

PARAMS = {
    "cispo": {"eps_max": 4.0},
    "tis_reinforce": {"eps_max": 4.0},
    "ppo_clip": {"clip_low": 0.2, "clip_high": 0.2},
    "dapo": {"clip_low": 0.2, "clip_high": 0.26},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
}


def make_batch(prompts: int, per_prompt: int, seq_len: int):
    g = torch.Generator().manual_seed(0)
    samples = prompts * per_prompt
    logprobs = -torch.rand(samples, seq_len, generator=g) * 3
    gen_logprobs = logprobs + 0.2 * torch.randn(samples, seq_len, generator=g)
    old_logprobs = logprobs + 0.1 * torch.randn(samples, seq_len, generator=g)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (samples,), generator=g)
    mask = torch.arange(seq_len) < lengths[:, None]
    advantages = torch.randn(samples, generator=g)
    group_ids = torch.arange(samples) // per_prompt
    return dict(logprobs=logprobs, gen_logprobs=gen_logprobs, old_logprobs=old_logprobs, mask=mask,
                advantages=advantages, group_ids=group_ids)


def naive_loss(name: str, batch: dict, logprobs: torch.Tensor) -> torch.Tensor:
    """Prompt-aggregated -J: for each prompt, its token objectives summed over its tokens / its tokens; mean."""
    p = PARAMS[name]
    per_prompt = []
    for prompt in batch["group_ids"].unique():
        rows = (batch["group_ids"] == prompt).nonzero().squeeze(1)
        lp, gen, old = logprobs[rows], batch["gen_logprobs"][rows], batch["old_logprobs"][rows]
        mask = batch["mask"][rows].to(lp.dtype)
        adv = batch["advantages"][rows].unsqueeze(1)
        if name == "cispo":
            objective = torch.clamp(torch.exp(lp - gen), max=p["eps_max"]).detach() * adv * lp
        elif name == "tis_reinforce":
            objective = torch.clamp(torch.exp(old - gen), max=p["eps_max"]) * adv * lp
        else:
            if name == "gspo":
                seq_ratio = torch.exp(((lp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True))
                ratio = seq_ratio.detach() * torch.exp(lp - lp.detach())
            else:
                ratio = torch.exp(lp - old)
            clipped = torch.clamp(ratio, 1 - p["clip_low"], 1 + p["clip_high"])
            objective = torch.minimum(ratio * adv, clipped * adv)
        per_prompt.append((objective * mask).sum() / mask.sum())
    return -torch.stack(per_prompt).mean()


def ours_loss(name: str, batch: dict, logprobs: torch.Tensor) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "logprobs"}
    loss, _ = policy_loss(name, logprobs=logprobs, aggregation="prompt", **inputs, **PARAMS[name])
    return loss


VARIANTS = {"ours": ours_loss, "naive": naive_loss}


def fresh_leaf(batch: dict) -> torch.Tensor:
    return batch["logprobs"].clone().requires_grad_()


def run_once(variant: str, name: str, batch: dict, logprobs: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(seconds for forward + backward, loss, gradient); `logprobs` is a fresh leaf (allocated outside the pass)."""
    start = time.perf_counter()
    loss = VARIANTS[variant](name, batch, logprobs)
    loss.backward()
    return time.perf_counter() - start, loss.detach(), logprobs.grad


def torch_peak_mib(variant: str, name: str, batch: dict) -> float:
    """Peak of torch CPU allocations during one pass, above the level before it (profiler memory events)."""
    logprobs = fresh_leaf(batch)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_once(variant, name, batch, logprobs)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak / 2**20


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB -> MiB


def child(args) -> None:
    variant, name = args.child.split(":")
    batch = make_batch(args.prompts, args.per_prompt, args.seq_len)
    run_once(variant, name, batch, fresh_leaf(batch))  # warm-up: lazy init, thread pools
    logprobs = fresh_leaf(batch)
    base = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter (VmHWM)
    run_once(variant, name, batch, logprobs)
    print(json.dumps({"rss_peak_mib": _status_mib("VmHWM") - base}))


def rss_peak_mib(args, variant: str, name: str) -> float:
    cmd = [sys.executable, __file__, "--child", f"{variant}:{name}", "--prompts", str(args.prompts),
           "--per-prompt", str(args.per_prompt), "--seq-len", str(args.seq_len)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    return json.loads(out)["rss_peak_mib"]


def bench_loss(args, name: str, batch: dict) -> dict:
    _, ours_value, ours_grad = run_once("ours", name, batch, fresh_leaf(batch))
    _, naive_value, naive_grad = run_once("naive", name, batch, fresh_leaf(batch))
    grad_diff = float((ours_grad - naive_grad).abs().max() / naive_grad.abs().max())
    loss_diff = float((ours_value - naive_value).abs() / naive_value.abs())
    if grad_diff > 1e-4 or loss_diff > 1e-4:
        raise SystemExit(f"{name}: policy_loss disagrees with the naive reference (loss rel {loss_diff:.2e}, "
                         f"grad rel {grad_diff:.2e})")
    del ours_grad, naive_grad
    seconds = {v: statistics.median(run_once(v, name, batch, fresh_leaf(batch))[0] for _ in range(args.repeats))
               for v in VARIANTS}
    torch_peak = {v: torch_peak_mib(v, name, batch) for v in VARIANTS}
    rss_peak = {v: rss_peak_mib(args, v, name) for v in VARIANTS}
    return {
        "ours_s": round(seconds["ours"], 4), "naive_s": round(seconds["naive"], 4),
        "speedup": round(seconds["naive"] / seconds["ours"], 2),
        "ours_torch_peak_mib": round(torch_peak["ours"], 1), "naive_torch_peak_mib": round(torch_peak["naive"], 1),
        "torch_peak_ratio": round(torch_peak["ours"] / torch_peak["naive"], 3),
        "ours_rss_peak_mib": round(rss_peak["ours"], 1), "naive_rss_peak_mib": round(rss_peak["naive"], 1),
        "rss_peak_ratio": round(rss_peak["ours"] / max(rss_peak["naive"], 1e-9), 3),
        "loss_rel_diff": float(f"{loss_diff:.2e}"), "grad_rel_diff": float(f"{grad_diff:.2e}"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="quick run: 8 prompts x 16 samples x 2048 tokens")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--per-prompt", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--losses", default=",".join(LOSSES), help="comma-separated loss names")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.prompts, args.seq_len = 8, 2048
    if args.child:
        return child(args)
    names = args.losses.split(",")
    unknown = [n for n in names if n not in LOSSES]
    if unknown:
        p.error(f"unknown loss {unknown[0]} (known: {', '.join(LOSSES)})")
    batch = make_batch(args.prompts, args.per_prompt, args.seq_len)
    results = {}
    for name in names:
        results[name] = r = bench_loss(args, name, batch)
        print(f"{name:14s} time {r['ours_s']:.3f}s vs naive {r['naive_s']:.3f}s (x{r['speedup']}); peak torch "
              f"{r['ours_torch_peak_mib']:.0f} vs {r['naive_torch_peak_mib']:.0f} MiB ({r['torch_peak_ratio']}); "
              f"peak RSS {r['ours_rss_peak_mib']:.0f} vs {r['naive_rss_peak_mib']:.0f} MiB ({r['rss_peak_ratio']})",
              flush=True)
    print(json.dumps({
        "bench": "losses", "device": "cpu", "threads": torch.get_num_threads(),
        "samples": args.prompts * args.per_prompt,
        "seq_len": args.seq_len, "loss_tokens": int(batch["mask"].sum()), "aggregation": "prompt",
        "results": results,
    }))


if __name__ == "__main__":
    main()
