#!/usr/bin/env python
"""Thin CLI: `python eval/watch.py ARGS` is `scalerl eval watch ARGS` (megatron_scalerl/evaluation/cli.py)."""

import sys

from megatron_scalerl.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "watch", *sys.argv[1:]]))
