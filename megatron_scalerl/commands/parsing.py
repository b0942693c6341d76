"""The parser conventions every `scalerl` command shares (`commands/__init__.py` assembles the commands; each
command's module adds its own arguments): usage errors are one line and exit 2, as `UserError`s are."""

from __future__ import annotations

import argparse

from megatron_scalerl.errors import UserError


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's usage errors: one line, exit 2
        raise UserError(f"{self.prog}: {message}")


def command_group(parser: argparse.ArgumentParser, metavar: str) -> argparse._SubParsersAction:
    """`scalerl NAME ...` where NAME's `parser` has sub-commands of its own (one required, shown as `metavar`), added
    to the returned object; their parsers report usage errors as `UserError` too."""
    name = parser.prog.split()[-1]
    commands = parser.add_subparsers(dest=f"{name}_command", metavar=metavar, parser_class=type(parser))
    commands.required = True
    return commands
