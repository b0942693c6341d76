"""`scalerl verify`: our Megatron models against Hugging Face transformers, at any layout (cli.py, parity.py).

It sits above `models/`, `checkpoint/` and `trainer/`: the model and optimizer it checks are built by the trainer's
own `trainer.setup`, so what is verified is what trains.
"""
