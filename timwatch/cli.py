"""The ``timwatch`` program's entry point (`main`): it checks that the extra the command needs is
installed before importing typer (which itself comes with an extra), then runs the typer app of
`timwatch.commands` (with only the command it runs mounted) through
`timwatch.monitor.cli.program.run`.

A command whose extra is missing prints one line on stderr naming the extra
(``timwatch serve needs the [server] extra: pip install 'timwatch[server]'``) and exits 2, as
does a module of an extra found missing while the command runs. `app` is the typer app, imported
on first use.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .monitor.core.extras import COMMANDS, hint, missing_for

__all__ = ["main"]


def _command(argv: Sequence[str]) -> str | None:
    """The command word of ``argv``: its first argument that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def preflight(argv: Sequence[str]) -> str | None:
    """The one-line message for ``argv`` when the extra its command needs lacks a module here;
    None when the command can run (or is not a command, which typer then refuses)."""
    command = _command(argv)
    known = command if command in COMMANDS else None
    if missing_for(known) is None:
        return None
    if known is None:  # the program itself (typer) is missing: most commands come with [server]
        return hint("timwatch", "server") + " (or [proxy] for timwatch sidecar alone)"
    return hint(f"timwatch {known}", COMMANDS[known])


def main(argv: Sequence[str] | None = None) -> None:
    """Run the program on ``argv`` (default ``sys.argv[1:]``) and exit with its code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:
        from .monitor.core.version import __version__

        print(f"timwatch {__version__}")  # what the app's eager --version prints
        sys.exit(0)
    message = preflight(args)
    if message is not None:
        print(message, file=sys.stderr, flush=True)
        sys.exit(2)
    from .commands import program
    from .monitor.cli.program import run

    sys.exit(run(program(_command(args)), args))


def __getattr__(name: str) -> Any:
    if name == "app":
        from .commands import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
