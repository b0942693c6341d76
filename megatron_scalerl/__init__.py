"""megatron-scalerl: the ScaleRL recipe at cluster scale (Megatron-core trainers, vLLM generators, SLURM)."""

__version__ = "0.1.0"
