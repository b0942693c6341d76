"""Benchmark: chunked fused FP32 log-probs vs naive full logits, forward + backward, one rank.

Time: both run in this process on the same inputs (median of --repeats). Peak memory: each variant runs once in a
fresh child process: after a warm-up pass the peak-RSS counter is reset (/proc/self/clear_refs) and the child
reports its peak RSS above the RSS it had before the measured pass (CPU torch has no allocator statistics). Goal: chunked <= 1/4 of naive memory, similar time.

    python bench/logprobs.py [--tokens 8192 --hidden 256 --vocab 16384 --chunk 1024 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from megatron_scalerl.trainer.logprobs import naive_token_logprobs, token_logprobs


def make_inputs(tokens: int, hidden: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, t


def run_once(variant: str, h, w, t, chunk: int) -> float:
    h.grad = w.grad = None
    start = time.perf_counter()
    if variant == "chunked":
        lp, _ = token_logprobs(h, w, t, chunk_tokens=chunk)
    else:
        lp, _ = naive_token_logprobs(h, w, t)
    lp.sum().backward()
    return time.perf_counter() - start


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB -> MiB


def child(args) -> None:
    h, w, t = make_inputs(args.tokens, args.hidden, args.vocab)
    run_once(args.child, h, w, t, args.chunk)  # warm-up: lazy init, thread pools
    h.grad = w.grad = None
    base = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak-RSS counter (VmHWM)
        f.write("5")
    run_once(args.child, h, w, t, args.chunk)
    print(json.dumps({"peak_mib": _status_mib("VmHWM") - base}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    h, w, t = make_inputs(args.tokens, args.hidden, args.vocab)
    times = {v: statistics.median(run_once(v, h, w, t, args.chunk) for _ in range(args.repeats))
             for v in ("naive", "chunked")}
    peaks = {}
    for v in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--child", v, "--tokens", str(args.tokens), "--hidden", str(args.hidden),
               "--vocab", str(args.vocab), "--chunk", str(args.chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        peaks[v] = json.loads(out)["peak_mib"]
    full_logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} chunk={args.chunk} "
          f"(one FP32 logits tensor = {full_logits_mib:.0f} MiB)")
    print(f"{'':10} {'fwd+bwd s':>10} {'peak MiB':>10}")
    for v in ("naive", "chunked"):
        print(f"{v:10} {times[v]:10.3f} {peaks[v]:10.1f}")
    result = {
        "bench": "logprobs", "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "chunk": args.chunk,
        "naive_s": round(times["naive"], 4), "chunked_s": round(times["chunked"], 4),
        "time_ratio_chunked_over_naive": round(times["chunked"] / times["naive"], 3),
        "naive_peak_mib": round(peaks["naive"], 1), "chunked_peak_mib": round(peaks["chunked"], 1),
        # None where the naive pass's peak did not rise above the RSS it had (logits too small to measure)
        "memory_ratio_chunked_over_naive": round(peaks["chunked"] / peaks["naive"], 4) if peaks["naive"] > 0 else None,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
