"""The batches the trainer learns from: the contract (`train_batch.TrainBatch`) and the transport that carries
them from the orchestrator to the trainer (`stream`: `BatchWriter`, `BatchReader`, `RolloutStream`)."""
