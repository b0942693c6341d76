"""Errors that mean "bad input from the user": the CLI prints them as one line and exits 2, never a traceback."""


class UserError(Exception):
    """Bad input (file, field, value, peer). The message names what is wrong and where."""

    exit_code = 2


class RecipeError(UserError):
    """A recipe does not load or does not validate. `path` is the dotted field path (e.g. `trainer.lr`)."""

    def __init__(self, path: str, reason: str, source: str | None = None):
        self.path = path
        self.reason = reason
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {reason}" if path else f"{where}{reason}")
