"""`python -m megatron_scalerl ...`: the `scalerl` command (`megatron_scalerl.commands`)."""

from megatron_scalerl.commands import entry

if __name__ == "__main__":
    entry()
