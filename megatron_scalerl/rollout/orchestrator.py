"""`python -m megatron_scalerl.rollout.orchestrator ...`: the old name of `python -m megatron_scalerl.orchestrator`,
kept so that existing scripts keep working (same flags)."""

import sys

from megatron_scalerl.orchestrator.orchestrator import main

if __name__ == "__main__":
    sys.exit(main())
