"""``timwatch diagnose RUN``: why the mismatch of RUN is what it is — the ranked causes of
``GET /v1/runs/{run}/diagnosis`` as a table (or ``--json``), with the evidence and the setting
to change. A client of a running server, like ``timwatch show``."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..client import DEFAULT_URL
from ..core.errors import ConfigError
from ..core.jsoncodec import dumps
from ..core.numfmt import sig3
from .history import JsonOpt, RunArg, TokenOpt, UrlOpt, ask

__all__ = ["diagnose", "render_diagnosis"]

#: a cause at or above this score is shown as present (`timwatch.monitor.diagnosis.FIRES`;
#: repeated here so the CLI does not import the rules)
FIRES = 0.5


def _num(v: Any) -> str:
    """Steps exact, measured values by `sig3`, a missing one as a dash."""
    if v is None:
        return "-"
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else sig3(v)


def render_diagnosis(res: dict[str, Any], console: Console) -> None:
    """The diagnosis as rich tables: causes ranked, then their evidence, then not checked."""
    span = f"steps {res['from_step']}–{res['to_step']}" if res["steps"] else "no steps"
    console.print(
        f"run [bold]{escape(res['run'])}[/bold] · {res['steps']} steps · {span}", highlight=False
    )
    t = Table("#", "cause", "score", "verdict", "action", show_lines=True)
    for i, c in enumerate(res["causes"], 1):
        mark = "[bold red]" if c["score"] >= FIRES else ""
        end = "[/bold red]" if mark else ""
        t.add_row(
            str(i), f"{mark}{escape(c['cause'])}{end}", sig3(c["score"]),
            escape(c["verdict"]), escape(c["action"]) if c["score"] >= FIRES else "-",
        )  # fmt: skip
    console.print(t)
    ev = Table("cause", "metric", "steps", "value", "trend", "detail")
    for c in res["causes"]:
        for e in c["evidence"]:
            first, last = e["steps"]
            ev.add_row(
                escape(c["cause"]), escape(e["metric"]), f"{_num(first)}–{_num(last)}",
                _num(e["value"]), _num(e["trend"]), escape(e["detail"]),
            )  # fmt: skip
    if ev.row_count:
        console.print(ev)
    scalars = res.get("scalars")
    if scalars:
        names = ", ".join(f"{k}={_num(v)}" for k, v in scalars["last"].items())
        console.print(
            f"trainer scalars: {scalars['steps']} steps "
            f"({_num(scalars['from_step'])}–{_num(scalars['to_step'])}) from "
            f"{escape(', '.join(scalars['sources']))}; last: {escape(names)} "
            "(the trainer's numbers, not read by the rules)"
        )
    if res["not_checked"]:
        nc = Table("not checked", "reason")
        for n in res["not_checked"]:
            nc.add_row(escape(n["cause"]), escape(n["reason"]))
        console.print(nc)


def diagnose(
    run: RunArg,
    from_step: Annotated[
        int | None, typer.Option(min=0, help="first step, inclusive (default: the first)")
    ] = None,
    to_step: Annotated[
        int | None, typer.Option(min=0, help="last step, inclusive (default: the last)")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    json: JsonOpt = False,
) -> None:
    """Rank the likely causes of RUN's mismatch, with evidence and what to change."""
    if from_step is not None and to_step is not None and from_step > to_step:
        raise ConfigError(f"--from-step {from_step} is after --to-step {to_step}")
    res = ask(url, token, lambda c: c.diagnosis(run, from_step=from_step, to_step=to_step))
    if json:
        sys.stdout.write(dumps(res).decode() + "\n")
        return
    render_diagnosis(res, Console())
