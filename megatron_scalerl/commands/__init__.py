"""The `scalerl` command: one module per subcommand in this package, imported only when that subcommand is chosen.

    scalerl COMMAND ...                      # console script (`entry`); also `python -m megatron_scalerl.commands`
    main(["recipe", "show", "scalerl"])      # the same from Python; returns the exit code

`COMMANDS` is the static table of every subcommand: its name, the module holding its command line and its one-line
help. `scalerl --help` lists the table without importing any command module; `scalerl NAME ...` imports NAME's
module alone and calls its `register(parser)`, which adds the arguments (a command with sub-commands:
`parsing.command_group`) and sets `func(args) -> int`. Bad input raises `UserError`: printed as one line, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Iterable
from typing import NoReturn

from megatron_scalerl.commands.parsing import Parser
from megatron_scalerl.errors import UserError
from megatron_scalerl.families.llama4.rope_note import quiet_if_said
from megatron_scalerl.process_exit import exit_with

# name: (module, one-line help), in the order `scalerl --help` lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "recipe": ("megatron_scalerl.commands.recipe", "show, explain, compare and validate recipes"),
    "forecast": ("megatron_scalerl.commands.forecast", "fit, compare and backtest compute-performance curves"),
    "convert": ("megatron_scalerl.commands.convert", "convert checkpoints between HF and Megatron layouts"),
    "verify": ("megatron_scalerl.commands.verify", "check converted models against Hugging Face"),
    "serve": ("megatron_scalerl.commands.serve", "start a vLLM generator server (weight transfer, FP32 head, API key)"),
    "train": ("megatron_scalerl.commands.train",
              "run a whole RL run on this machine (generators, trainer, orchestrator)"),
    "demo": ("megatron_scalerl.commands.demo",
             "the one-command CPU demo: build, warm-start and RL-train a tiny model"),
    "sweep": ("megatron_scalerl.commands.sweep", "run variants x seeds of a recipe (locally or on SLURM), then their "
                                                 "ablation report; `sweep report` for the report alone"),
    "eval": ("megatron_scalerl.commands.eval",
             "downstream evaluation (AIME, local benchmarks) of an endpoint or of a run's checkpoints"),
    "grade": ("megatron_scalerl.commands.grade", "grade completions with a verifier (check data and verifiers)"),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The `scalerl` parser. Every command of `COMMANDS` is listed; those named in `commands` (None: all) get their
    whole command line, which imports their modules."""
    wanted = set(COMMANDS if commands is None else commands)
    parser = Parser(prog="scalerl", description="ScaleRL post-training at cluster scale.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name, (module, help) in COMMANDS.items():
        command = sub.add_parser(name, help=help, description=help)
        if name in wanted:
            importlib.import_module(module).register(command)
    return parser


def _chosen(argv: list[str]) -> list[str]:
    """The command `argv` names (its first word that is not an option), if it is one of `COMMANDS`."""
    first = next((word for word in argv if not word.startswith("-")), None)
    return [first] if first in COMMANDS else []


def main(argv: list[str] | None = None) -> int:
    # `scalerl ... | head` ends quietly; the caller's own handling comes back after (main called from Python)
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    quiet_if_said()  # a run's processes: transformers' note on Scout's RoPE scaling was said once by the launcher
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(_chosen(argv)).parse_args(argv)
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGPIPE, previous)


def entry() -> NoReturn:
    """The `scalerl` console script and `python -m megatron_scalerl[.commands]`: `main` on the command line, the
    process ended by `process_exit.exit_with` (no interpreter teardown)."""
    exit_with(main)
