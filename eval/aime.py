#!/usr/bin/env python
"""Thin CLI: `python eval/aime.py ARGS` is `scalerl eval aime ARGS` (megatron_scalerl/commands/eval.py)."""

import sys

from megatron_scalerl.commands import main

if __name__ == "__main__":
    sys.exit(main(["eval", "aime", *sys.argv[1:]]))
