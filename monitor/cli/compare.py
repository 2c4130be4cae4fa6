"""``timwatch compare A B`` and ``timwatch gate RUN --baseline FILE|RUN``.

Both read the runs' history from one of three places: a running server (``--url``, the
default), a store directly (``--db URL``, e.g. the demo's SQLite file) or, with no service at
all, a directory of batch files (``--batches DIR``: ``DIR/RUN/*.json|*.safetensors``,
`timwatch.monitor.compare.batchdir`). ``gate`` exits 0 when the run passes, 1 when it fails, 2
on any error (one line on stderr naming the problem, `timwatch.monitor.cli.program`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..client import DEFAULT_URL
from ..core.errors import ConfigError, InputError
from ..core.jsoncodec import dumps
from ..core.runid import check_run_id
from ..diagnosis.series import SERIES_COLUMNS
from .history import JsonOpt, TokenOpt, UrlOpt, ask

if TYPE_CHECKING:
    from ..diagnosis import StepSeries

__all__ = ["compare", "gate"]

BatchesOpt = Annotated[
    Path | None,
    typer.Option(
        "--batches", metavar="DIR", show_default=False,
        help="read runs from batch files, DIR/RUN/*.json|*.safetensors (no server needed)",
    ),
]  # fmt: skip
DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db", metavar="URL", show_default=False,
        help="read runs from this store (SQLAlchemy URL) instead of a server",
    ),
]  # fmt: skip
FromOpt = Annotated[
    int | None, typer.Option(min=0, help="first step, inclusive (default: the first)")
]
ToOpt = Annotated[int | None, typer.Option(min=0, help="last step, inclusive (default: the last)")]
SeedOpt = Annotated[int, typer.Option(help="seed of the bootstrap's resampling")]


class Source:
    """Where runs are read from; `series` answers a `StepSeries`, `tags` the run's tags."""

    def __init__(self, url: str, token: str | None, db: str | None, batches: Path | None):
        if db is not None and batches is not None:
            raise ConfigError("give --db or --batches, not both")
        self.url, self.token, self.db, self.batches = url, token, db, batches

    def _store(self, fn: Callable[[Any], Any]) -> Any:
        from ..store import Store

        store = Store(self.db or "", migrate=False)
        try:
            return fn(store)
        finally:
            store.close()

    def series(self, run: str, from_step: int | None, to_step: int | None) -> StepSeries:
        from ..diagnosis import StepSeries

        if self.batches is not None:
            from ..compare import load_batch_dir

            return load_batch_dir(self.batches, run, from_step, to_step)
        if self.db is not None:
            from ..diagnosis import load_series

            def read(store: Any) -> StepSeries:
                if check_run_id(run) or not store.run_exists(run):
                    raise InputError("run", f"unknown run {run!r} in {self.db}")
                return load_series(store, run, from_step, to_step)

            return self._store(read)
        res = ask(
            self.url, self.token,
            lambda c: c.metrics(run, SERIES_COLUMNS, from_step=from_step, to_step=to_step),
        )  # fmt: skip
        return StepSeries.build(run, res["steps"], res["series"])

    def tags(self, run: str) -> dict[str, Any]:
        if self.batches is not None:
            return {}
        if self.db is not None:
            runs = self._store(lambda s: s.list_runs())
        else:
            runs = ask(self.url, self.token, lambda c: c.runs())
        return next((r.get("tags") or {} for r in runs if r.get("run", r.get("id")) == run), {})


def _range(from_step: int | None, to_step: int | None) -> None:
    if from_step is not None and to_step is not None and from_step > to_step:
        raise ConfigError(f"--from-step {from_step} is after --to-step {to_step}")


def _nonempty(s: StepSeries) -> StepSeries:
    if not len(s):
        raise InputError("steps", f"run {s.run!r} has no steps in the range asked")
    return s


def compare(
    run_a: Annotated[str, typer.Argument(help="reference run (A)", show_default=False)],
    run_b: Annotated[str, typer.Argument(help="run compared with it (B)", show_default=False)],
    from_step: FromOpt = None,
    to_step: ToOpt = None,
    seed: SeedOpt = 0,
    md: Annotated[bool, typer.Option("--markdown", help="print Markdown")] = False,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    db: DbOpt = None,
    batches: BatchesOpt = None,
    json: JsonOpt = False,
) -> None:
    """Compare run B with run A: headline metrics side by side, B/A with a 95 % bootstrap
    interval, where the difference lives, one verdict line."""
    _range(from_step, to_step)
    src = Source(url, token, db, batches)
    if db is None and batches is None:
        res = ask(url, token, lambda c: c.compare(run_a, run_b, from_step=from_step,
                                                  to_step=to_step, seed=seed))  # fmt: skip
    else:
        from ..compare import compare_series

        a = _nonempty(src.series(run_a, from_step, to_step))
        b = _nonempty(src.series(run_b, from_step, to_step))
        res = compare_series(a, b, seed=seed).to_dict()
    from ..compare import comparison_markdown

    if json:
        sys.stdout.write(dumps(res).decode() + "\n")
    elif md:
        sys.stdout.write(comparison_markdown(res))
    else:
        render_comparison(res, Console())


def render_comparison(res: dict[str, Any], console: Console) -> None:
    from ..compare.comparison import fmt_ratio
    from ..compare.formats import fmt

    console.print(escape(res["verdict"]), highlight=False)
    t = Table("metric", f"A: {escape(res['a'])}", f"B: {escape(res['b'])}", "B/A", "95 % interval")
    for m in res["metrics"]:
        iv = "-" if m["lo"] is None else f"{fmt_ratio(m['lo'])}–{fmt_ratio(m['hi'])}"
        t.add_row(m["metric"], fmt(m["a"]), fmt(m["b"]), fmt_ratio(m["ratio"]), iv)
    console.print(t)
    if res["where"]:
        w = Table("where", "A", "B", "B/A")
        for x in res["where"]:
            w.add_row(escape(x["label"]), fmt(x["a"]), fmt(x["b"]), fmt_ratio(x["ratio"]))
        console.print(w)


def gate(
    runs: Annotated[
        list[str],
        typer.Argument(
            metavar="RUN",
            help="the candidate run; with --write-baseline, one or more runs of the same "
            "settings (several give the baseline their run-to-run spread)",
            show_default=False,
        ),
    ],
    baseline: Annotated[
        str | None,
        typer.Option(
            metavar="FILE|RUN",
            show_default=False,
            help="a baseline file (from --write-baseline) or a baseline run",
        ),
    ] = None,
    write_baseline: Annotated[
        Path | None,
        typer.Option(metavar="FILE", show_default=False, help="write the RUNs as a baseline file"),
    ] = None,
    model: Annotated[
        str | None, typer.Option(show_default=False, help="the model (default: the run's tag)")
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(show_default=False, help="the engine and version (default: the run's tag)"),
    ] = None,
    metric: Annotated[
        list[str] | None,
        typer.Option(show_default=False, help="with --write-baseline: a metric to gate (repeat)"),
    ] = None,
    max_ratio: Annotated[
        float, typer.Option(min=1.0, help="with --write-baseline: allowed run/baseline ratio")
    ] = 1.5,
    max_abs: Annotated[
        float, typer.Option(min=0.0, help="with --write-baseline: allowed absolute increase")
    ] = 0.0,
    from_step: FromOpt = None,
    to_step: ToOpt = None,
    junit: Annotated[
        Path | None, typer.Option(metavar="FILE", show_default=False, help="write JUnit XML")
    ] = None,
    md: Annotated[
        Path | None,
        typer.Option("--markdown", metavar="FILE", show_default=False, help="write Markdown"),
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    db: DbOpt = None,
    batches: BatchesOpt = None,
    json: JsonOpt = False,
) -> None:
    """Gate RUN against a baseline for CI: exit 0 pass, 1 fail, 2 error."""
    from ..compare import Baseline, junit_xml, markdown
    from ..compare import gate as run_gate
    from ..compare.comparison import fmt_ratio
    from ..compare.formats import fmt
    from ..compare.gate import check_metrics, make_baseline

    _range(from_step, to_step)
    if (baseline is None) == (write_baseline is None):
        raise ConfigError("give --baseline FILE|RUN or --write-baseline FILE")
    if baseline is not None and len(runs) > 1:
        raise ConfigError(f"gate one run at a time: got {len(runs)} ({', '.join(runs)})")
    if metric:
        check_metrics(metric)
    src = Source(url, token, db, batches)
    run = runs[0]
    series = _nonempty(src.series(run, from_step, to_step))
    tags: dict[str, Any] | None = None

    def ident(which: str, given: str | None) -> str:
        nonlocal tags
        if given is not None:
            return given
        if tags is None:
            tags = src.tags(run)
        found = tags.get(which)
        if not found:
            raise ConfigError(f"name the run's --{which}: run {run!r} has no {which} tag")
        return str(found)

    if write_baseline is not None:
        every = [series, *(_nonempty(src.series(r, from_step, to_step)) for r in runs[1:])]
        b = make_baseline(every, model=ident("model", model), engine=ident("engine", engine),
                          metrics=metric, max_ratio=max_ratio, max_abs=max_abs)  # fmt: skip
        try:
            b.dump(write_baseline)
        except OSError as exc:
            raise ConfigError(f"cannot write {write_baseline}: {exc.strerror}") from None
        sys.stdout.write(
            f"wrote baseline {write_baseline}: {', '.join(b.metrics)} of {b.run} "
            f"({b.model} on {b.engine}, steps {b.steps[0]}–{b.steps[1]})\n"
        )
        return
    assert baseline is not None
    if Path(baseline).is_file() or baseline.endswith(".json"):
        base = Baseline.load(baseline)
        m, e = ident("model", model), ident("engine", engine)
    else:
        m, e = ident("model", model), ident("engine", engine)
        ref = _nonempty(src.series(baseline, from_step, to_step))
        base = make_baseline(ref, model=m, engine=e, metrics=metric,
                             max_ratio=max_ratio, max_abs=max_abs)  # fmt: skip
    result = run_gate(series, base, model=m, engine=e)
    for path, text in (
        (junit, junit_xml(result) if junit else ""),
        (md, markdown(result) if md else ""),
    ):
        if path is not None:
            try:
                path.write_text(text, encoding="utf-8")
            except OSError as exc:
                raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
    if json:
        sys.stdout.write(dumps(result.to_dict()).decode() + "\n")
    else:
        console = Console()
        word = "[bold green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
        console.print(
            f"{word} run [bold]{escape(run)}[/bold] against baseline {escape(base.run)} "
            f"({escape(base.model)} on {escape(base.engine)}), steps "
            f"{result.steps[0]}–{result.steps[1]}", highlight=False,
        )  # fmt: skip
        t = Table("metric", "run", "baseline", "ratio", "limit", "noise", "steps", "result")
        for c in result.checks:
            t.add_row(c.metric, fmt(c.mean), fmt(c.baseline.mean), fmt_ratio(c.ratio),
                      fmt(c.limit), fmt(c.noise), str(c.n),
                      "pass" if c.passed else "[bold red]FAIL[/]")  # fmt: skip
        console.print(t)
    if not result.passed:
        raise typer.Exit(1)
