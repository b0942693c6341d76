"""Checkpoint directories and Megatron distributed checkpoints, below both `models/`-level tools and `trainer/`.

    store.py    CheckpointStore: atomic publication, checksummed manifests, fallback and set-aside, pruning
    sharded.py  megatron dist_checkpointing save/load (layout-independent), the model config a checkpoint records,
                and loading a checkpoint's model weights into a model at any layout
"""
