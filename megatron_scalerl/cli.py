"""`python -m megatron_scalerl.cli ...`: the old module name of the `scalerl` command, kept so that existing scripts
keep working; the command lines live in `megatron_scalerl.commands`."""

import sys

from megatron_scalerl.commands import main

if __name__ == "__main__":
    sys.exit(main())
