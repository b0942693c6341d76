"""`python -m megatron_scalerl.orchestrator --run-dir RUN [--resume]`: the orchestrator process."""

import sys

from megatron_scalerl.orchestrator.orchestrator import main

if __name__ == "__main__":
    sys.exit(main())
