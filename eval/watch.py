#!/usr/bin/env python
"""Thin CLI: `python eval/watch.py ARGS` is `scalerl eval watch ARGS` (megatron_scalerl/commands/eval.py)."""

import sys

from megatron_scalerl.commands import main

if __name__ == "__main__":
    sys.exit(main(["eval", "watch", *sys.argv[1:]]))
