"""Run a function on N gloo ranks in worker processes (tests only)."""

import datetime
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(world: int, fn, *args) -> None:
    """Call fn(rank, *args) on `world` gloo ranks; `fn` must be a module-level function. Raises if any rank fails."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
