"""The rich live view of `timwatch demo`: one verdict line per step (printed above the live part,
so it stays in the scrollback), and a progress bar under a table of the latest rows.

Rows are what the running service stored (read back through its history API), not numbers the
demo computed itself, so the view shows exactly what `timwatch query` and Grafana will show.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .verdict import Level, judge

__all__ = ["COLUMNS", "MASKS", "METRICS", "LiveView", "make_console", "verdict_line"]

# (history column, header): the headline table, then the mask ratio of every policy (shadow)
METRICS = (
    ("mismatch_kl", "mismatch KL"),
    ("discrepancy_kl", "engine KL"),
    ("staleness_kl", "stale KL"),
    ("is_ratio_std", "IS std"),
    ("noise_scale", "σ̂²"),
    ("entropy_mean", "H mean"),
    ("version_lag_max", "lag"),
)
MASKS = (
    ("mask_ratio_estr", "estr"),
    ("mask_ratio_delta_abs", "δ_abs"),
    ("mask_ratio_icepop", "icepop"),
    ("mask_ratio_kpop", "kpop"),
    ("mask_ratio_tis", "tis"),
    ("mask_ratio_seq_mis", "seq_mis"),
    ("mask_ratio_geo_rs", "geo_rs"),
    ("mask_ratio_k3_rs", "k3_rs"),
)
COLUMNS = METRICS + MASKS


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if v != 0 else "0"
    return str(v)


MARKS = {Level.HEALTHY: ("✓", "green"), Level.WATCH: ("!", "yellow"), Level.BAD: ("✗", "bold red")}


def make_console() -> Console:
    console = Console(highlight=False)
    # piped output (CI logs) gets a readable width instead of 80 columns
    return console if console.is_terminal else Console(width=110, highlight=False)


def verdict_line(row: dict[str, Any]) -> Text:
    """``step   2  reward 0.21  ✗ <verdict>`` for one stored row."""
    v = judge(row)
    mark, style = MARKS[v.level]
    line = Text(f"step {row['step']:>3}  reward {_fmt(row.get('reward')):>5}  ")
    line.append(f"{mark} ", style=style)
    line.append(v.text, style=style if v.level is not Level.HEALTHY else "")
    return line


class LiveView:
    """``with LiveView(steps, title) as v: v.update(done, rows)``; `update` prints the verdict line
    of every row it sees for the first time, in step order, also when disabled or exited."""

    def __init__(
        self, steps: int, title: str, *, show_rows: int = 10, enabled: bool = True,
        console: Console | None = None,
    ) -> None:  # fmt: skip
        self.console = console or make_console()
        self.title = title
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=self.console,
        )  # fmt: skip
        self.task = self.progress.add_task("steps", total=steps)
        self.rows: deque[dict[str, Any]] = deque(maxlen=show_rows)
        self.enabled = enabled
        self.logged = -1
        self._live: Live | None = None

    def _table(self, title: str, cols: tuple[tuple[str, str], ...], reward: bool) -> Table:
        t = Table(title=title, title_justify="left", header_style="bold cyan")
        t.add_column("step", justify="right")
        if reward:
            t.add_column("reward", justify="right")
        for _, header in cols:
            t.add_column(header, justify="right")
        for row in self.rows:
            lead = [str(row["step"])] + ([_fmt(row.get("reward"))] if reward else [])
            t.add_row(*lead, *(_fmt(row.get(c)) for c, _ in cols))
        return t

    def table(self) -> Group:
        return Group(
            self._table(self.title, METRICS, reward=True),
            self._table("mask ratio per policy (shadow evaluation)", MASKS, reward=False),
        )

    def render(self) -> Group:
        return Group(self.table(), self.progress)

    def __enter__(self) -> LiveView:
        if self.enabled:
            self._live = Live(self.render(), console=self.console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(*exc)
            self._live = None

    def update(self, done: int, rows: list[dict[str, Any]]) -> None:
        known = {r["step"]: r for r in self.rows}
        for row in rows:
            known[row["step"]] = {**known.get(row["step"], {}), **row}
        self.rows.clear()
        self.rows.extend(sorted(known.values(), key=lambda r: r["step"])[-self.rows.maxlen :])  # type: ignore[operator]
        for row in sorted(rows, key=lambda r: int(r["step"])):
            if row["step"] > self.logged:
                self.console.print(verdict_line(known[row["step"]]))
                self.logged = row["step"]
        self.progress.update(self.task, completed=done)
        if self._live is not None:
            self._live.update(self.render())
