"""Report figures reused for the same inputs (`timwatch.monitor.report.figcache`): a figure is
drawn once per distinct input, any change in the data draws it again, and the cache stays
under its byte bound, least recently used dropped first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.report_runs import ingest_steps
from timwatch.monitor.report import build_report, figcache, plots
from timwatch.monitor.store import Store


@pytest.fixture()
def draws(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many figures were really drawn (calls of `plots._png`), the global cache emptied
    before and after."""
    count = [0]
    real = plots._png

    def counting(fig: object) -> str:
        count[0] += 1
        return real(fig)  # type: ignore[arg-type]

    monkeypatch.setattr(plots, "_png", counting)
    figcache.CACHE.clear()
    yield count
    figcache.CACHE.clear()


def _curve(values: list[float], dtype: type = np.float64) -> plots.Curve:
    return ("kl", np.arange(len(values)), np.array(values, dtype=dtype))


def test_the_same_inputs_draw_once_and_answer_the_same_figure(draws: list[int]) -> None:
    a = plots.series_png("t", [_curve([1e-4, 2e-4, 3e-4])], [(0.02, "high")], log=True)
    # equal inputs built anew (other array objects) are the same key
    b = plots.series_png("t", [_curve([1e-4, 2e-4, 3e-4])], [(0.02, "high")], log=True)
    assert a == b and a.startswith("data:image/png;base64,")
    assert draws[0] == 1
    assert (figcache.CACHE.hits, figcache.CACHE.misses) == (1, 1)


@pytest.mark.parametrize(
    "change",
    ["value", "dtype", "title", "threshold", "log", "function"],
)
def test_any_change_in_the_inputs_draws_again(draws: list[int], change: str) -> None:
    plots.series_png("t", [_curve([1e-4, 2e-4])], [(0.02, "high")], log=True)
    args: dict[str, object] = {
        "title": "t", "curves": [_curve([1e-4, 2e-4])], "thresholds": [(0.02, "high")],
        "log": True,
    }  # fmt: skip
    if change == "value":
        args["curves"] = [_curve([1e-4, 2.0000001e-4])]
    elif change == "dtype":
        args["curves"] = [_curve([1e-4, 2e-4], np.float32)]
    elif change == "title":
        args["title"] = "u"
    elif change == "threshold":
        args["thresholds"] = [(0.03, "high")]
    elif change == "log":
        args["log"] = False
    if change == "function":
        plots.buckets_png({"0": {"mismatch_kl": 1e-3}}, None)
    else:
        plots.series_png(
            args["title"],
            args["curves"],
            args["thresholds"],
            log=args["log"],  # type: ignore[arg-type]
        )
    assert draws[0] == 2
    assert figcache.CACHE.misses == 2 and figcache.CACHE.hits == 0


def test_the_cache_stays_under_its_bound_oldest_unused_dropped_first() -> None:
    cache = figcache.FigureCache(max_bytes=100)
    drawn: list[str] = []

    def draw(v: str) -> str:
        drawn.append(v)
        return v

    a, b, c = "a" * 40, "b" * 40, "c" * 40
    cache.get_or_draw(b"a", lambda: draw(a))
    cache.get_or_draw(b"b", lambda: draw(b))
    cache.get_or_draw(b"a", lambda: draw(a))  # a used last: b is now the oldest
    cache.get_or_draw(b"c", lambda: draw(c))
    assert cache.size == 80 <= cache.max_bytes
    cache.get_or_draw(b"a", lambda: draw(a))
    cache.get_or_draw(b"b", lambda: draw(b))  # dropped: drawn again
    assert drawn == [a, b, c, b]
    big = "x" * 101
    assert cache.get_or_draw(b"big", lambda: draw(big)) == big
    assert cache.size <= cache.max_bytes
    cache.get_or_draw(b"big", lambda: draw(big))  # larger than the bound: never kept
    assert drawn[-2:] == [big, big]


def test_a_report_asked_again_reuses_its_figures_until_a_new_step_arrives(
    draws: list[int], tmp_path: Path
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'r.db'}", sqlite_synchronous="OFF")
    try:
        ingest_steps(store, "r", 20)
        first = build_report(store, "r")
        once = draws[0]
        assert once >= 6
        build_report(store, "r")
        assert draws[0] == once  # nothing drawn again
        ingest_steps(store, "r2", 1)  # another run: r's figures stay valid
        build_report(store, "r")
        assert draws[0] == once
        ingest_steps(store, "r", 1, first=20)
        again = build_report(store, "r")
        assert draws[0] > once and again != first
        assert "21 steps, steps 0–20" in again
    finally:
        store.close()


def test_inputs_that_cannot_be_digested_are_drawn_every_time() -> None:
    calls: list[int] = []

    @figcache.cached
    def figure(title: str, label: object) -> str:
        calls.append(1)
        return f"data:{title}"

    figcache.CACHE.clear()
    try:
        assert figure("t", lambda: 0) == figure("t", lambda: 0) == "data:t"  # not picklable
        assert len(calls) == 2 and figcache.CACHE.size == 0
        figure("t", "x")
        figure("t", "x")
        assert len(calls) == 3 and figcache.CACHE.hits == 1
    finally:
        figcache.CACHE.clear()
