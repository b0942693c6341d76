#!/usr/bin/env python
"""Thin CLI: `python eval/report.py ARGS` is `scalerl eval report ARGS` (megatron_scalerl/evaluation/cli.py)."""

import sys

from megatron_scalerl.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "report", *sys.argv[1:]]))
