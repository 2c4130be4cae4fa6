"""History commands of ``timwatch``: runs, query, show, report (clients of a running server).

They raise `ConfigError` for what the user can fix (no server at the URL, a refused token, an
unknown run, step or metric); `timwatch.monitor.cli.program.run` prints it as one line.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..client import DEFAULT_URL
from ..core.errors import ConfigError, TimwatchHTTPError
from ..core.jsoncodec import dumps

if TYPE_CHECKING:
    from ..client import TimwatchClient

__all__ = ["REPORT_METRICS", "ask", "history_app"]

T = TypeVar("T")

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

UrlOpt = Annotated[str, typer.Option("--url", envvar="TIMWATCH_URL", help="server URL")]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="bearer token (default: $TIMWATCH_TOKEN, else $TIMWATCH_READ_TOKEN)",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object")]
RunArg = Annotated[str, typer.Argument(help="run name", show_default=False)]


def ask(
    url: str,
    token: str | None,
    call: Callable[[TimwatchClient], T],
    token_env: str = "TIMWATCH_READ_TOKEN",
) -> T:
    """``call`` on a client of the server at ``url``; transport failures and 4xx answers
    become one-line `ConfigError`s that say what to change (a refused token: set ``--token``
    or `token_env`). httpx loads here, not when the ``timwatch`` program starts."""
    import httpx

    from ..client import TimwatchClient

    try:
        client = TimwatchClient(url, token=token)
    except httpx.InvalidURL as exc:
        raise ConfigError(f"--url {url!r} is not a URL ({exc}): e.g. {DEFAULT_URL}") from None
    with client:
        try:
            return call(client)
        except httpx.UnsupportedProtocol:
            raise ConfigError(
                f"--url {client.url!r} needs http:// or https://: e.g. {DEFAULT_URL}"
            ) from None
        except httpx.TransportError:
            raise ConfigError(
                f"cannot reach timwatch at {client.url}: is `timwatch serve` running there? "
                "(set --url or TIMWATCH_URL)"
            ) from None
        except TimwatchHTTPError as exc:
            if exc.status in (401, 403):
                raise ConfigError(
                    f"timwatch at {client.url} refused the token ({exc.status}: {exc.detail}): "
                    f"set --token or {token_env}"
                ) from None
            if 400 <= exc.status < 500:
                raise ConfigError(exc.detail) from None
            raise


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return escape(str(v))


@history_app.command()
def runs(url: UrlOpt = DEFAULT_URL, token: TokenOpt = None, json: JsonOpt = False) -> None:
    """List the runs the server knows."""
    items = ask(url, token, lambda c: c.runs())
    if json:
        sys.stdout.write(dumps(items).decode() + "\n")
        return
    t = Table("run", "steps", "last step", "first seen (UTC)", "last seen (UTC)", "tags")
    for r in items:
        tags = ", ".join(f"{k}={v}" for k, v in (r.get("tags") or {}).items())
        scalar_steps = r.get("scalar_steps") or 0
        steps = str(r["steps"]) + (f" +{scalar_steps} scalar" if scalar_steps else "")
        t.add_row(
            escape(r["run"]), steps, _fmt(r["last_step"]), _when(r["first_seen"]),
            _when(r["last_seen"]), escape(tags),
        )  # fmt: skip
    console.print(t)


@history_app.command()
def query(
    run: RunArg,
    metric: Annotated[
        list[str] | None,
        typer.Option("--metric", "-m", help="metric name (repeat for several)"),
    ] = None,
    last: Annotated[
        int | None, typer.Option(help="only the last N steps (default: all)", show_default=False)
    ] = None,
    from_step: Annotated[
        int | None, typer.Option(help="first step, inclusive (default: the first)")
    ] = None,
    to_step: Annotated[
        int | None, typer.Option(help="last step, inclusive (default: the last)")
    ] = None,
    csv: Annotated[bool, typer.Option("--csv", help="print CSV")] = False,
    scalars: Annotated[
        bool,
        typer.Option(
            "--scalars",
            help="the trainer's own scalars (Tap.log, POST /v1/runs/RUN/scalars) by canonical "
            "name instead of the per-token metrics; -m picks names (default: all stored)",
        ),
    ] = False,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Print metric series of RUN by step (--scalars: the trainer's own scalars)."""
    if scalars:
        _query_scalars(run, metric, from_step, to_step, last, csv, url, token)
        return
    if not metric:
        raise ConfigError(
            "missing option --metric NAME (or --scalars for the trainer's scalars); "
            "see timwatch query --help"
        )
    res = ask(
        url,
        token,
        lambda c: c.metrics(run, metric, from_step=from_step, to_step=to_step, last=last, csv=csv),
    )
    if csv:
        sys.stdout.write(res)
        return
    t = Table("step", *(escape(m) for m in metric))
    for i, s in enumerate(res["steps"]):
        t.add_row(str(s), *(_fmt(res["series"][m][i]) for m in metric))
    console.print(t)


def _query_scalars(
    run: str,
    names: list[str] | None,
    from_step: int | None,
    to_step: int | None,
    last: int | None,
    csv: bool,
    url: str,
    token: str | None,
) -> None:
    res = ask(
        url,
        token,
        lambda c: c.scalars(run, names, from_step=from_step, to_step=to_step, last=last),
    )
    cols = list(res["scalars"])
    if csv:
        lines = [",".join(["step", *cols])]
        for i, s in enumerate(res["steps"]):
            vals = (res["scalars"][n][i] for n in cols)
            lines.append(",".join([str(s), *("" if v is None else repr(v) for v in vals)]))
        sys.stdout.write("\n".join(lines) + "\n")
        return
    sources = sorted({v for v in res["sources"].values() if v}) or ["canonical names"]
    t = Table(
        "step", *(escape(n) for n in cols),
        caption=f"trainer scalars of {escape(run)} (from: {escape(', '.join(sources))})",
    )  # fmt: skip
    for i, s in enumerate(res["steps"]):
        t.add_row(str(s), *(_fmt(res["scalars"][n][i]) for n in cols))
    console.print(t)


@history_app.command()
def show(
    run: RunArg,
    step: Annotated[int, typer.Argument(help="step number", show_default=False)],
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    json: JsonOpt = False,
) -> None:
    """Print one step's row and details (buckets, worst tokens)."""
    from .render import render_details, render_row

    res = ask(url, token, lambda c: c.step(run, step))
    if json:
        sys.stdout.write(dumps(res).decode() + "\n")
        return
    console.print(
        f"run [bold]{escape(run)}[/bold] step {step} · {res['batches']} batch(es)", highlight=False
    )
    render_row(res["row"], console)
    render_details(res["row"], console)


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
def report(
    run: RunArg,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    json: JsonOpt = False,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="write the incident report page (one self-contained HTML file) to FILE",
            metavar="FILE",
            show_default=False,
        ),
    ] = None,
    from_step: Annotated[
        int | None, typer.Option(help="with --html: first step, inclusive (default: the first)")
    ] = None,
    to_step: Annotated[
        int | None, typer.Option(help="with --html: last step, inclusive (default: the last)")
    ] = None,
    against: Annotated[
        str | None,
        typer.Option(
            metavar="RUN",
            show_default=False,
            help="with --html: open the page with RUN compared against (timwatch compare)",
        ),
    ] = None,
) -> None:
    """Summarise RUN's headline metrics over its whole history (--html FILE: write the
    incident report page instead)."""
    if html is not None:
        page = ask(
            url, token,
            lambda c: c.report_html(run, from_step=from_step, to_step=to_step, against=against),
        )  # fmt: skip
        try:
            html.write_text(page, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot write --html {str(html)!r}: {exc.strerror}") from None
        sys.stdout.write(f"wrote {html} ({len(page.encode()):,} bytes)\n")  # unwrapped: a path
        return
    if from_step is not None or to_step is not None or against is not None:
        raise ConfigError("--from-step, --to-step and --against go with --html FILE")
    res = ask(url, token, lambda c: c.metrics(run, REPORT_METRICS))
    summary = {m: summarize(res["steps"], res["series"][m]) for m in REPORT_METRICS}
    if json:
        sys.stdout.write(dumps({"run": run, "metrics": summary}).decode() + "\n")
        return
    steps = res["steps"]
    span = f"steps {steps[0]}–{steps[-1]}" if steps else "no steps"
    console.print(f"run [bold]{escape(run)}[/bold] · {len(steps)} steps · {span}", highlight=False)
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
