"""Test-wide environment: offline wandb and HF hub, one thread per process (2-core CI machines)."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
