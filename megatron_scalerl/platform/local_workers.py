"""Run a function on N local worker processes joined in one process group, collect the results.

Used by commands that must run a multi-rank layout from a single user command (`scalerl verify logits --tp 2`) and
by the multi-process tests. Each worker calls `init_distributed` itself, runs `fn(rank, *args)`, and sends its
return value back (it must be picklable). The first failure or a worker that dies stops all of them, and the error
names the rank; a run longer than `timeout_s` is stopped too. `backend` is passed to `init_distributed`
("gloo" by default; "auto" gives one GPU per worker with nccl on a GPU machine). The caller's module needs an
`if __name__ == "__main__":` guard.

CPU (gloo) workers are forked from a forkserver that imported megatron-core once (`worker_imports`), so each run
starts in well under a second instead of about 9 s per worker; a worker takes the caller's environment variables
and working directory at its start, as a spawned one would. GPU workers are spawned (nothing CUDA is forked).
"""

from __future__ import annotations

import os
import pickle
import queue
import secrets
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from megatron_scalerl.platform.cpu_compat import silence_cpu_import_warnings
from megatron_scalerl.platform.distributed import destroy_distributed, init_distributed, resolve_backend
from megatron_scalerl.ports import LISTEN_PORTS


def free_port() -> int:
    """A TCP port of LISTEN_PORTS that was free a moment ago on 127.0.0.1, drawn at random (two launches that draw
    at once rarely meet)."""
    for _ in range(200):
        port = LISTEN_PORTS.start + secrets.randbelow(len(LISTEN_PORTS))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port in {LISTEN_PORTS.start}-{LISTEN_PORTS.stop - 1} after 200 draws")


class WorkerError(RuntimeError):
    """A worker process failed; the message holds its rank and traceback."""


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    environ: dict[str, str],
    cwd: str,
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    import torch

    if not torch.cuda.is_available():
        silence_cpu_import_warnings()
    torch.set_num_threads(threads)
    try:
        init_distributed(backend, timeout_s, rank=rank, world_size=world_size, local_rank=rank,
                         master_addr="127.0.0.1", master_port=port, store_hosted=True)  # not the caller's MASTER_ADDR
        # Every rank's connections made before any runs `fn`: a rank whose `fn` needs no collective would otherwise
        # finish and close its end while a slower one is still connecting to it ("Gloo connectFullMesh failed ...
        # Connection closed by peer" there).
        torch.distributed.barrier()
        value = fn(rank, *args)
        # Pickled here, by value: torch's queue would share tensor storage through file descriptors that die with
        # this process, which may exit before the parent reads the result.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including SystemExit from argparse-style code
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy_distributed()
        except Exception:  # noqa: S110 - the process ends next; the result above already says what happened
            pass


WORKER_IMPORTS = "megatron_scalerl.platform.worker_imports"


def _start_context(backend: str) -> Any:
    """How workers start: forked from the forkserver preloaded with `worker_imports` for gloo, spawned for nccl."""
    if backend != "gloo":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([WORKER_IMPORTS])  # no effect once this process's forkserver runs (see tasks.rewards)
    return ctx


def run_local_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    threads_per_worker: int = 1,
) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` spawned processes; return their results in rank order.

    `fn` must be importable by module path (a top-level function). `timeout_s` (seconds) bounds the whole run
    and every collective inside it.
    """
    import datetime

    import torch.distributed as dist

    ctx = _start_context(resolve_backend(backend))
    results = ctx.Queue()
    # The rendezvous store, bound here on a port the kernel picks (free_port() would leave a window in which another
    # process, e.g. a gloo connection of a concurrent test, takes the port); it lives until the workers are done.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    port = store.port
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(rank, world_size, port, backend, timeout_s, threads_per_worker, fn, args, results,
                  dict(os.environ), os.getcwd()),
            daemon=False,  # workers may start processes of their own (dist_checkpointing save)
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    raise WorkerError(
                        f"worker rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before reporting"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(collected))
                    raise WorkerError(f"workers {missing} did not finish within {timeout_s:g} s") from None
                continue
            if not ok:
                raise WorkerError(f"worker rank {rank} of {world_size} failed:\n{value}")
            collected[rank] = pickle.loads(value)
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
    return [collected[rank] for rank in range(world_size)]
