"""Checkpoint directories and Megatron distributed checkpoints, below both `models/`-level tools and `trainer/`.

    store.py            CheckpointStore: atomic publication, checksummed manifests, fallback and set-aside, pruning
    sharded.py          megatron dist_checkpointing save/load (layout-independent), the model config a checkpoint
                        records, and loading a checkpoint's model weights into a model at any layout
    unpickling.py       a checkpoint's `.metadata` unpickled through an allow-list of torch's metadata classes
    load_strategies.py  megatron's load strategies with that reader, objects and `common.pt` read weights-only
"""
