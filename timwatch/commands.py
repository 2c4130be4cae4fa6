"""The ``timwatch`` program's typer app: it mounts the commands of the monitor and of the
sidecar. It lives above both packages, so neither imports the other's commands; every heavy
module (numba, FastAPI, torch) is imported by the command that needs it, when it runs.
`timwatch.cli.main` runs it (plain help, one-line errors) once the command's extra is there.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .monitor.cli.analyze import analyze
from .monitor.cli.compare import compare, gate
from .monitor.cli.dashboards import dashboards_app
from .monitor.cli.diagnose import diagnose
from .monitor.cli.history import history_app
from .monitor.cli.lifecycle import finish
from .monitor.cli.serve import serve
from .monitor.core.version import __version__
from .sidecar.cli import sidecar_app
from .sidecar.demo.run import demo

__all__ = ["app"]

app = typer.Typer(
    name="timwatch",
    help="Train–inference mismatch monitoring for LLM RL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"timwatch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Train–inference mismatch monitoring for LLM RL."""


app.command("demo")(demo)
app.command("serve")(serve)
app.command("analyze")(analyze)
app.command("finish")(finish)
app.registered_commands.extend(history_app.registered_commands)
app.command("diagnose")(diagnose)
app.command("compare")(compare)
app.command("gate")(gate)
app.add_typer(dashboards_app, name="dashboards", help="Grafana dashboards.")
app.add_typer(sidecar_app, name="sidecar", help="Collectors in front of rollout engines.")
