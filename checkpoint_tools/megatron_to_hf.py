#!/usr/bin/env python
"""Thin CLI: `python checkpoint_tools/megatron_to_hf.py --megatron DIR --out DIR [--tp N --pp N --ep N] [--verify]`
is `scalerl convert megatron-to-hf ...` (megatron_scalerl/commands/convert.py; the code: megatron_scalerl/models/convert.py)."""

import sys

from megatron_scalerl.commands import main

if __name__ == "__main__":
    sys.exit(main(["convert", "megatron-to-hf", *sys.argv[1:]]))
