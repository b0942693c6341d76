import sys

from megatron_scalerl.trainer.trainer import main

if __name__ == "__main__":
    sys.exit(main())
