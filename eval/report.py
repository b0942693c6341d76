#!/usr/bin/env python
"""Thin CLI: `python eval/report.py ARGS` is `scalerl eval report ARGS` (megatron_scalerl/commands/eval.py)."""

import sys

from megatron_scalerl.commands import main

if __name__ == "__main__":
    sys.exit(main(["eval", "report", *sys.argv[1:]]))
