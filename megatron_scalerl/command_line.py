"""The parser conventions every `scalerl` command shares (`cli.py` assembles the commands; each part registers its
own): usage errors are one line and exit 2, as `UserError`s are."""

from __future__ import annotations

import argparse

from megatron_scalerl.errors import UserError


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's usage errors: one line, exit 2
        raise UserError(f"{self.prog}: {message}")


def command_group(sub: argparse._SubParsersAction, name: str, help: str, metavar: str) -> argparse._SubParsersAction:
    """`scalerl NAME ...`: a command whose own sub-commands (one required, shown as `metavar`) are added to the
    returned object; its parsers report usage errors as `UserError` too."""
    group = sub.add_parser(name, help=help)
    commands = group.add_subparsers(dest=f"{name}_command", metavar=metavar, parser_class=type(group))
    commands.required = True
    return commands
