"""Running a typer app the way a user meets it: help without type noise, and every error as one
line on stderr (``timwatch serve: port 8000 is in use: try --port 8001``), never a traceback.

Exit codes: 0 success, 2 anything the user can fix (bad flag, bad input, unreachable server,
unusable database: every `TimwatchError` and `OSError`; a module of an extra that is not installed,
``timwatch serve needs the [postgres] extra: pip install 'timwatch[postgres]'``), 1 a bug (the
message says how to see the traceback: ``TIMWATCH_DEBUG=1``), 130 Ctrl-C. Commands raise; only
`run` prints errors.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import typer
import typer.main
from typer import Abort
from typer._click.core import Command, Context, Parameter
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
from typer.core import TyperArgument, TyperGroup

from ..core.errors import TimwatchError
from ..core.extras import extra_for, hint

__all__ = ["DEBUG_ENV", "one_line", "run", "tidy"]

#: set to print the traceback of an unexpected error instead of its one-line summary
DEBUG_ENV = "TIMWATCH_DEBUG"

_LABELS = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "path": "PATH", "bool": ""}


def _label(shown: str | None) -> str:
    """``<int range>`` → ``INTEGER``, ``<list[str]>`` → ``TEXT`` (repeatable options say so in
    their help), ``<bool>`` → nothing."""
    core = (shown or "").strip("<>").removesuffix(" range")
    if core.startswith("list[") and core.endswith("]"):
        core = core[5:-1]
    return _LABELS.get(core.lower(), core if "|" in core else core.upper())


class _Argument(TyperArgument):
    """An argument shown as ``RUN`` in usage lines (optional ones as ``[RUN]``), typed like the
    options (``TEXT``, ``INTEGER``)."""

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        return (name if self.required else f"[{name}]") + ("..." if self.nargs != 1 else "")

    def display_type_rich(self, ctx: Context) -> str | None:
        return _label(self.display_type(ctx))


def _tidy_param(param: Parameter, ctx: Context) -> None:
    if isinstance(param, TyperArgument):
        if param.metavar is None:
            param.metavar = (param.name or "value").upper()
        param.__class__ = _Argument
    elif param.metavar is None:
        flag = bool(getattr(param, "is_flag", False))
        shown = getattr(param, "display_type_rich", lambda _ctx: None)(ctx)
        param.metavar = "" if flag else _label(shown)


def tidy(command: Command, ctx: Context | None = None) -> Command:
    """Give every parameter of ``command`` and of its sub-commands a plain metavar (``FLOAT``,
    ``TEXT``, nothing for flags, ``RUN`` for arguments) in place of typer's ``<float>``,
    ``<bool>`` and ``{run}``. Idempotent; returns ``command``."""
    ctx = ctx or Context(command, info_name=command.name)
    for param in command.get_params(ctx):  # includes the lazily made --help option
        _tidy_param(param, ctx)
    if isinstance(command, TyperGroup):
        for name, sub in command.commands.items():
            tidy(sub, Context(sub, info_name=name, parent=ctx))
    return command


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(text.split())


def _command_path(command: Command, prog_name: str, args: Sequence[str]) -> str:
    """``timwatch serve`` for ``["serve", "--db", ...]``: the deepest (sub)command named."""
    path = [prog_name]
    for arg in args:
        if not isinstance(command, TyperGroup):
            break
        if arg.startswith("-"):
            continue
        sub = command.commands.get(arg)
        if sub is None:
            break
        path.append(arg)
        command = sub
    return " ".join(path)


def _fail(path: str, message: str, code: int) -> int:
    print(f"{path}: {one_line(message)}", file=sys.stderr, flush=True)
    return code


def run(app: typer.Typer, args: Sequence[str] | None = None, prog_name: str = "timwatch") -> int:
    """Run ``app`` on ``args`` (default ``sys.argv[1:]``) and return its exit code."""
    argv = list(sys.argv[1:] if args is None else args)
    command = tidy(typer.main.get_command(app))
    path = _command_path(command, prog_name, argv)
    try:
        rv = command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except NoArgsIsHelpError:
        return 2  # the help text is already printed
    except UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else path
        return _fail(where, f"{exc.format_message()} (see {where} --help)", 2)
    except ClickException as exc:
        return _fail(path, exc.format_message(), exc.exit_code)
    except Abort:
        return _fail(path, "aborted", 1)
    except (TimwatchError, OSError) as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        return _fail(path, str(exc) or type(exc).__name__, 2)
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        word = path.split()[1] if " " in path else None
        extra = extra_for(exc.name or "", word) if isinstance(exc, ModuleNotFoundError) else None
        if extra is not None:  # a module of an extra this installation lacks
            print(hint(path, extra), file=sys.stderr, flush=True)
            return 2
        return _fail(
            path,
            f"unexpected {type(exc).__name__}: {exc} (rerun with {DEBUG_ENV}=1 for the traceback)",
            1,
        )
    return rv if isinstance(rv, int) else 0
