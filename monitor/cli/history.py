"""History commands of ``timwatch``: runs, query, show, report (clients of a running server)."""

from __future__ import annotations

import math
import statistics
import sys
from datetime import datetime, timezone
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from timwatch.monitor.client import TimwatchClient, TimwatchHTTPError
from timwatch.monitor.core.jsoncodec import dumps

__all__ = ["REPORT_METRICS", "history_app"]

history_app = typer.Typer(no_args_is_help=True, add_completion=False)
console = Console()

REPORT_METRICS = (
    "mismatch_kl",
    "is_ratio_std",
    "log_ratio_abs_max",
    "log_ratio_abs_p99",
    "mask_ratio_estr",
    "mask_ratio_icepop",
    "entropy_mean",
    "noise_scale",
    "version_lag_max",
    "token_id_mismatch_ratio",
)

UrlOpt = Annotated[
    str | None, typer.Option("--url", envvar="TIMWATCH_URL", help="server URL", show_default=False)
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", help="bearer token (default TIMWATCH_TOKEN / TIMWATCH_READ_TOKEN)"),
]


def _client(url: str | None, token: str | None) -> TimwatchClient:
    return TimwatchClient(url, token=token)


def _fail(e: Exception) -> typer.Exit:
    console.print(f"[red]error:[/red] {e}", highlight=False)
    return typer.Exit(1)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


@history_app.command()
def runs(url: UrlOpt = None, token: TokenOpt = None, json: bool = False) -> None:
    """List the runs the server knows."""
    try:
        with _client(url, token) as c:
            items = c.runs()
    except (TimwatchHTTPError, httpx.HTTPError, OSError) as e:
        raise _fail(e) from None
    if json:
        sys.stdout.write(dumps(items).decode() + "\n")
        return
    t = Table("run", "steps", "last step", "first seen (UTC)", "last seen (UTC)", "tags")
    for r in items:
        tags = ", ".join(f"{k}={v}" for k, v in (r.get("tags") or {}).items())
        t.add_row(
            r["run"], str(r["steps"]), _fmt(r["last_step"]), _when(r["first_seen"]),
            _when(r["last_seen"]), tags,
        )  # fmt: skip
    console.print(t)


@history_app.command()
def query(
    run: str,
    metric: Annotated[list[str], typer.Option("--metric", "-m", help="metric (repeatable)")],
    last: Annotated[int | None, typer.Option(help="only the last N steps")] = None,
    from_step: Annotated[int | None, typer.Option(help="first step (inclusive)")] = None,
    to_step: Annotated[int | None, typer.Option(help="last step (inclusive)")] = None,
    csv: Annotated[bool, typer.Option("--csv", help="print CSV")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Print metric series of RUN by step."""
    try:
        with _client(url, token) as c:
            res = c.metrics(run, metric, from_step=from_step, to_step=to_step, last=last, csv=csv)
    except (TimwatchHTTPError, httpx.HTTPError, OSError) as e:
        raise _fail(e) from None
    if csv:
        sys.stdout.write(res)
        return
    t = Table("step", *metric)
    for i, s in enumerate(res["steps"]):
        t.add_row(str(s), *(_fmt(res["series"][m][i]) for m in metric))
    console.print(t)


@history_app.command()
def show(
    run: str, step: int, url: UrlOpt = None, token: TokenOpt = None, json: bool = False
) -> None:
    """Print one step's row and details (buckets, worst tokens)."""
    try:
        with _client(url, token) as c:
            res = c.step(run, step)
    except (TimwatchHTTPError, httpx.HTTPError, OSError) as e:
        raise _fail(e) from None
    if json:
        sys.stdout.write(dumps(res).decode() + "\n")
        return
    row = res["row"]
    console.print(f"run [bold]{run}[/bold] step {step} · {res['batches']} batch(es)")
    t = Table("metric", "value")
    for k, v in row.items():
        if not isinstance(v, (dict, list)):
            t.add_row(k, _fmt(v))
    for group in ("mask_ratio", "seq_reject_ratio"):
        for p, v in (row.get(group) or {}).items():
            t.add_row(f"{group}[{p}]", _fmt(v))
    console.print(t)
    worst = row.get("worst_tokens") or []
    if worst:
        w = Table(*(str(k) for k in worst[0]), title="worst tokens (by ESTR score)")
        for item in worst:
            w.add_row(*(_fmt(v) for v in item.values()))
        console.print(w)


def summarize(steps: list[int], values: list[Any]) -> dict[str, Any]:
    """Count, last, mean, max (and its step) and first-tenth → last-tenth change of a series."""
    pairs = [
        (s, float(v))
        for s, v in zip(steps, values, strict=True)
        if v is not None and math.isfinite(v)
    ]
    if not pairs:
        return {"steps": 0}
    xs = [v for _, v in pairs]
    top = max(pairs, key=lambda p: p[1])
    k = max(1, len(xs) // 10)
    head, tail = statistics.fmean(xs[:k]), statistics.fmean(xs[-k:])
    return {
        "steps": len(xs),
        "last": xs[-1],
        "mean": statistics.fmean(xs),
        "max": top[1],
        "max_step": top[0],
        "trend": (tail / head) if head > 0 else None,
    }


@history_app.command()
def report(run: str, url: UrlOpt = None, token: TokenOpt = None, json: bool = False) -> None:
    """Summarise RUN's headline metrics over its whole history."""
    try:
        with _client(url, token) as c:
            res = c.metrics(run, REPORT_METRICS)
    except (TimwatchHTTPError, httpx.HTTPError, OSError) as e:
        raise _fail(e) from None
    summary = {m: summarize(res["steps"], res["series"][m]) for m in REPORT_METRICS}
    if json:
        sys.stdout.write(dumps({"run": run, "metrics": summary}).decode() + "\n")
        return
    steps = res["steps"]
    span = f"steps {steps[0]}–{steps[-1]}" if steps else "no steps"
    console.print(f"run [bold]{run}[/bold] · {len(steps)} steps · {span}")
    t = Table("metric", "last", "mean", "max", "at step", "last/first tenth")
    for m, s in summary.items():
        if s["steps"]:
            t.add_row(
                m, _fmt(s["last"]), _fmt(s["mean"]), _fmt(s["max"]), str(s["max_step"]),
                _fmt(s["trend"]),
            )  # fmt: skip
        else:
            t.add_row(m, "-", "-", "-", "-", "-")
    console.print(t)
