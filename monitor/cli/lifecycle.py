"""``timwatch finish RUN``: tell a running server that a run is done (``POST
/v1/runs/{run}/finish``), so its series leave ``/metrics`` after the server's finish grace and
its stall alert stays quiet. An unknown run, an unreachable server or a refused token is one
line on stderr and exit 2 (`timwatch.monitor.cli.program.run`)."""

from __future__ import annotations

import sys
from datetime import datetime, timezone
from typing import Annotated

import typer

from ..client import DEFAULT_URL
from ..core.errors import ConfigError
from ..core.jsoncodec import dumps
from ..core.runid import check_run_id
from .history import RunArg, UrlOpt, ask

__all__ = ["finish"]

WriteTokenOpt = Annotated[
    str | None,
    typer.Option("--token", help="bearer token (default: $TIMWATCH_TOKEN)", show_default=False),
]


def finish(
    run: RunArg,
    url: UrlOpt = DEFAULT_URL,
    token: WriteTokenOpt = None,
    json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Mark RUN finished: it leaves /metrics after the server's --finish-grace and raises no
    stall alert; a later batch re-opens it."""
    problem = check_run_id(run)
    if problem:
        raise ConfigError(f"RUN {run[:80]!r}: {problem}")
    res = ask(url, token, lambda c: c.finish(run), token_env="TIMWATCH_TOKEN")
    if json:
        sys.stdout.write(dumps(res).decode() + "\n")
        return
    when = datetime.fromtimestamp(res["finished_at"], tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    state = "was already finished" if res.get("already_finished") else "finished"
    sys.stdout.write(f"run {res['run']} {state} at {when} UTC\n")
