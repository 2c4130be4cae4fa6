"""The ``timwatch`` program's typer app: it mounts the commands of the monitor and of the
sidecar. It lives above both packages, so neither imports the other's commands; every heavy
module (numba, FastAPI, torch) is imported by the command that needs it, when it runs.
`timwatch.cli.main` runs it (plain help, one-line errors) once the command's extra is there.

`program(word)` is the program with only the command ``word`` mounted, so a run imports that
command's module alone; the root, its options and that command's own options, help and errors
are the same as in `app`, the program with every command (help, an unknown word).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from .monitor.core.version import __version__

__all__ = ["COMMAND_WORDS", "app", "program"]

if TYPE_CHECKING:
    app: typer.Typer


def _version(value: bool) -> None:
    if value:
        typer.echo(f"timwatch {__version__}")
        raise typer.Exit()


def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Train–inference mismatch monitoring for LLM RL."""


def _demo(app: typer.Typer) -> None:
    from .sidecar.demo.run import demo

    app.command("demo")(demo)


def _serve(app: typer.Typer) -> None:
    from .monitor.cli.serve import serve

    app.command("serve")(serve)


def _analyze(app: typer.Typer) -> None:
    from .monitor.cli.analyze import analyze

    app.command("analyze")(analyze)


def _finish(app: typer.Typer) -> None:
    from .monitor.cli.lifecycle import finish

    app.command("finish")(finish)


def _history(name: str) -> Callable[[typer.Typer], None]:
    def mount(app: typer.Typer) -> None:
        from .monitor.cli.history import history_app

        for info in history_app.registered_commands:
            if name == (info.name or getattr(info.callback, "__name__", None)):
                app.registered_commands.append(info)

    return mount


def _diagnose(app: typer.Typer) -> None:
    from .monitor.cli.diagnose import diagnose

    app.command("diagnose")(diagnose)


def _compare(app: typer.Typer) -> None:
    from .monitor.cli.compare import compare

    app.command("compare")(compare)


def _gate(app: typer.Typer) -> None:
    from .monitor.cli.compare import gate

    app.command("gate")(gate)


def _dashboards(app: typer.Typer) -> None:
    from .monitor.cli.dashboards import dashboards_app

    app.add_typer(dashboards_app, name="dashboards", help="Grafana dashboards.")


def _sidecar(app: typer.Typer) -> None:
    from .sidecar.cli import sidecar_app

    app.add_typer(sidecar_app, name="sidecar", help="Collectors in front of rollout engines.")


#: command word → what mounts it, in the order of the program's help
_MOUNTS: dict[str, Callable[[typer.Typer], None]] = {
    "demo": _demo,
    "serve": _serve,
    "analyze": _analyze,
    "finish": _finish,
    **{name: _history(name) for name in ("runs", "query", "show", "report")},
    "diagnose": _diagnose,
    "compare": _compare,
    "gate": _gate,
    "dashboards": _dashboards,
    "sidecar": _sidecar,
}
COMMAND_WORDS = tuple(_MOUNTS)


def program(word: str | None) -> typer.Typer:
    """The program with the command ``word`` mounted, or every command when ``word`` is not
    one of `COMMAND_WORDS` (None: no command given)."""
    app = typer.Typer(
        name="timwatch",
        help="Train–inference mismatch monitoring for LLM RL.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    for name, mount in _MOUNTS.items():
        if word not in _MOUNTS or name == word:
            mount(app)
    return app


@functools.cache
def _whole() -> typer.Typer:
    return program(None)


def __getattr__(name: str) -> typer.Typer:
    if name == "app":  # the whole program, built once, on first use
        return _whole()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
