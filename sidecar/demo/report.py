"""What `timwatch demo` prints after its steps: the summary and the "where to look" hints.

Every command in a hint starts with `program()`, the command that runs *this* timwatch as the
user can paste it into the same shell (the bare name only when ``PATH`` finds this very program),
and names the history by an absolute location, so a hint works from any directory. Hints that
need the demo's server are printed only while it serves (``--hold``).
"""

from __future__ import annotations

import math
import shlex
import shutil
import sys
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from .live_view import MARKS
from .verdict import Level, advice, judge, num, worst_step

__all__ = ["history_url", "live_hints", "offline_hints", "program", "summary"]


def program(argv0: str | None = None, executable: str | None = None) -> str:
    """The pasteable command that runs the timwatch program this process was started as."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    executable = sys.executable if executable is None else executable
    path = Path(argv0)
    if not argv0 or path.suffix == ".py" or not path.is_file():
        return f"{shlex.quote(executable)} -m timwatch"
    found = shutil.which(path.name)
    if found and Path(found).resolve() == path.resolve():
        return path.name
    return shlex.quote(str(path.absolute()))


def history_url(db: str) -> str:
    """``db`` as a URL that means the same store from any directory (password hidden)."""
    from sqlalchemy.engine import make_url  # SQLAlchemy loads only when a demo runs

    u = make_url(db)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        return f"sqlite:///{Path(u.database).resolve()}"
    return u.render_as_string(hide_password=True)


def _where(db: str) -> str:
    from sqlalchemy.engine import make_url

    u = make_url(db)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        return str(Path(u.database).resolve())
    return history_url(db)


def _mean(rows: Sequence[Mapping[str, Any]], col: str) -> float:
    vals = [float(r[col]) for r in rows if r.get(col) is not None]
    return math.fsum(vals) / len(vals) if vals else float("nan")


def summary(
    console: Console, *, run: str, db: str, rows: Sequence[Mapping[str, Any]], planned: int,
    stats: Mapping[str, Any], wall_s: float, interrupted: bool,
) -> None:  # fmt: skip
    """Steps done, verdict counts, the worst step and why, the means, where the history is."""
    head = "Summary (interrupted)" if interrupted else "Summary"
    console.print(
        f"\n[bold]{head}[/bold]  {len(rows)} of {planned} steps stored in {wall_s:.1f} s · tap "
        f"sent {stats['sent']}, dropped {stats['dropped']}, failed {stats['failed']}"
    )
    verdicts = [judge(r) for r in rows]
    counts = {lv: sum(v.level is lv for v in verdicts) for lv in Level}
    console.print(
        f"  verdicts     {counts[Level.HEALTHY]} healthy · {counts[Level.WATCH]} watch · "
        f"{counts[Level.BAD]} bad   (rules: timwatch.sidecar.demo.verdict)"
    )
    worst = worst_step(rows)
    if worst is not None:
        step, v = worst
        mark, style = MARKS[v.level]
        console.print(Text(f"  worst step   {step} ").append(f"{mark} {v.text}", style=style))
    if rows:
        console.print(
            f"  means        mismatch_kl {num(_mean(rows, 'mismatch_kl'))} · engine part "
            f"(discrepancy_kl) {num(_mean(rows, 'discrepancy_kl'))} · staleness_kl "
            f"{num(_mean(rows, 'staleness_kl'))} · noise_scale σ̂² {num(_mean(rows, 'noise_scale'))}"
        )
    tip = advice(verdicts)
    if tip:
        console.print(f"  next         {tip}", markup=False)
    console.print(f"  history      run {run} in {_where(db)}", markup=False)


def _command(console: Console, label: str, command: str) -> None:
    """One hint: never wrapped (so it pastes as one line) and never read as rich markup."""
    console.print(f"  {label:<12} {command}", soft_wrap=True, markup=False)


def offline_hints(console: Console, *, run: str, db: str, prog: str | None = None) -> None:
    """Hints for after the demo has exited: serve the history it wrote, then query it."""
    p, r = prog or program(), shlex.quote(run)
    console.print(
        "\n[bold]Where to look[/bold]: the demo's server stopped with it (--hold keeps it up for "
        "/metrics and curl). Serve its history in one shell, query it from another:"
    )
    _command(console, "serve", f"{p} serve --db {shlex.quote(history_url(db))}")
    _command(console, "query", f"{p} query {r} -m mismatch_kl -m staleness_kl")
    _command(console, "report", f"{p} report {r}")


def live_hints(
    console: Console, *, run: str, url: str, worst: int | None, prog: str | None = None
) -> None:
    """Hints that need the demo's server, printed while it serves (``--hold``)."""
    p, r = prog or program(), shlex.quote(run)
    step = 0 if worst is None else worst  # the worst step: the one worth opening
    base = f"{url}/v1/runs/{urllib.parse.quote(run, safe='')}"
    console.print(f"\n[bold]Serving on {url}[/bold] — Ctrl-C to stop. In another shell:")
    _command(console, "Prometheus", f"curl -s {url}/metrics | grep '^timwatch_token_kl'")
    _command(console, "history API", f"curl -s '{base}/metrics?names=mismatch_kl,staleness_kl'")
    _command(console, "step API", f"curl -s '{base}/steps/{step}'")
    _command(console, "history CLI", f"{p} query {r} -m mismatch_kl -m staleness_kl --url {url}")
    _command(console, "step CLI", f"{p} show {r} {step} --url {url}")
