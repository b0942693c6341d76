"""`python -m megatron_scalerl ...`: the `scalerl` command (`megatron_scalerl.commands`)."""

import sys

from megatron_scalerl.commands import main

if __name__ == "__main__":
    sys.exit(main())
