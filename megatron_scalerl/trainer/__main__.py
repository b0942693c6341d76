import sys

from megatron_scalerl.trainer.role import main

if __name__ == "__main__":
    sys.exit(main())
