"""The one-command CPU demo (`make demo`): a tiny Llama-4 MoE and its tokenizer built locally, then RL on it."""
