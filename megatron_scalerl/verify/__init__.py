"""`scalerl verify`: our Megatron models against Hugging Face transformers, at any layout (parity.py; the command: commands/verify.py).

It sits above `models/`, `checkpoint/` and `trainer/`: the model and optimizer it checks are built by the trainer's
own `trainer.setup`, so what is verified is what trains.
"""
