#!/usr/bin/env python
"""Thin CLI: `python eval/aime.py ARGS` is `scalerl eval aime ARGS` (megatron_scalerl/evaluation/cli.py)."""

import sys

from megatron_scalerl.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "aime", *sys.argv[1:]]))
