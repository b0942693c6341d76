#!/usr/bin/env python
"""Thin CLI: `python checkpoint_tools/hf_to_megatron.py --hf DIR --out DIR [--tp N --pp N --ep N] [--verify]`
is `scalerl convert hf-to-megatron ...` (megatron_scalerl/commands/convert.py; the code: megatron_scalerl/models/convert.py)."""

import sys

from megatron_scalerl.commands import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
