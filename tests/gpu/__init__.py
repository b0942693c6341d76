"""GPU checks (`make gpu-check`): our GPU paths (NCCL, Transformer Engine, CUDA vLLM) on one node of 2-8 GPUs."""
