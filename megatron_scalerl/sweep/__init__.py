"""Sweeps: variants x seeds of one base recipe as runs (locally or on SLURM), resumable and extensible, ending with
their ablation report (`scalerl sweep`; docs/sweeps.md)."""
