"""`python -m megatron_scalerl.commands ...`: the `scalerl` command."""

import sys

from megatron_scalerl.commands import main

if __name__ == "__main__":
    sys.exit(main())
