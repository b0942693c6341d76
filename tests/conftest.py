"""Test-wide environment: offline wandb and HF hub, one thread per process (2-core CI machines)."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items):
    """Files that start vLLM servers first, then the other slow ones (a stable sort): with
    `-n 2 --dist loadfile --no-loadscope-reorder` (make test) the longest files start first and the short ones fill
    in at the end, instead of a vLLM file starting last."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("vllm") else 1 if item.get_closest_marker("slow") else 2)
