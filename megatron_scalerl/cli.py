"""The `scalerl` command. Each part of the stack registers its own subcommands here.

A part provides `register(subparsers)` which adds its parser(s) and sets `func(args) -> int` on them (a command with
sub-commands: `command_line.command_group`); heavy imports happen inside `func`, so `scalerl --help` stays fast. Bad input raises `UserError`: printed as one line, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from megatron_scalerl.command_line import Parser
from megatron_scalerl.errors import UserError

# Modules that contribute subcommands, in the order `scalerl --help` lists them.
COMMAND_MODULES = [
    "megatron_scalerl.recipe_cli",
    "megatron_scalerl.forecast_cli",
    "megatron_scalerl.convert_cli",
    "megatron_scalerl.verify.cli",
    "megatron_scalerl.inference.serve_cli",
    "megatron_scalerl.launch.cli",
    "megatron_scalerl.demo.run",
    "megatron_scalerl.sweep.cli",
    "megatron_scalerl.evaluation.cli",
    "megatron_scalerl.grade_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="scalerl", description="ScaleRL post-training at cluster scale.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `scalerl ... | head` ends quietly
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
