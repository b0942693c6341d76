"""The training half: TrainBatches in, optimizer steps and weight versions out (Megatron-core, TP/PP/EP/DP)."""
