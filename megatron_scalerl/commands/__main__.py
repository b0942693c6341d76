"""`python -m megatron_scalerl.commands ...`: the `scalerl` command."""

from megatron_scalerl.commands import entry

if __name__ == "__main__":
    entry()
