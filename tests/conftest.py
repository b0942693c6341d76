"""Test-wide environment: offline wandb and HF hub, one thread per process (2-core CI machines), one forkserver per
test process preloaded for both of its users, and the `bwrap` fixture of the code verifier's attack tests."""

import multiprocessing
import multiprocessing.forkserver
import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items):
    """Files that start vLLM servers first, then the other slow ones (a stable sort): with
    `-n 2 --dist loadfile --no-loadscope-reorder` (make test) the longest files start first and the short ones fill
    in at the end, instead of a vLLM file starting last."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("vllm") else 1 if item.get_closest_marker("slow") else 2)


@pytest.fixture(scope="session", autouse=True)
def shared_forkserver():
    """The trainer's local gloo workers (`platform.local_workers`) and the reward graders (`tasks.rewards`) both fork
    their workers from the process's one forkserver, which imports what its first user asks for. A test process runs
    both, in any order: start it with both preloads, so neither imports megatron-core or math-verify per worker."""
    from megatron_scalerl.platform.local_workers import WORKER_IMPORTS
    from megatron_scalerl.tasks.rewards import WORKER_PRELOAD

    multiprocessing.set_forkserver_preload([WORKER_IMPORTS, *WORKER_PRELOAD])
    multiprocessing.forkserver.ensure_running()


@pytest.fixture(scope="module")
def bwrap():
    """Skips, saying why, where the bubblewrap sandbox does not work (the attack tests grade under it)."""
    from megatron_scalerl.tasks.sandbox import SandboxError, sandbox_kind

    try:
        sandbox_kind("bwrap")
    except SandboxError as e:
        pytest.skip(str(e))
