"""megatron-scalerl: the ScaleRL recipe at cluster scale (Megatron-core trainers, vLLM generators, SLURM)."""

from megatron_scalerl.rope_note import quiet_if_said

__version__ = "0.1.0"

quiet_if_said()  # a run's processes: transformers' note on Scout's RoPE scaling was said once by the launcher
