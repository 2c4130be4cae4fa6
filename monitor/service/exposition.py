"""Incremental ``/metrics`` text: each run's lines are rendered once per change, not per scrape.

`Exposition.render` answers exactly what ``generate_latest`` answers for the same state: every
family's ``# HELP``/``# TYPE`` pair once, then its samples run by run in run-id order, then its
run-less samples (``timwatch_rejected_batches_total``). The lines of one run are cached per
family under the run's ``version`` (`RunRegistry` gives every change a fresh one), so a scrape
re-renders only the runs that changed since the last one, plus the run-less samples; an
evicted run's lines drop out with it. Text is produced by ``prometheus_client`` itself, one
family at a time, so escaping and number formatting cannot drift from a full render.

Invariant (tested in tests/unit/test_exposition.py): for any sequence of observe/reject/evict,
``Exposition(runs).render() == render(make_registry(runs))``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.core import Metric

from .exporter import TimwatchCollector
from .runs import RunRegistry, RunState

__all__ = ["Exposition"]


class _One:
    """What ``generate_latest`` needs of a registry, for one family."""

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self.metric


def _split(metric: Metric) -> tuple[bytes, bytes]:
    """(the ``# HELP``/``# TYPE`` lines, the sample lines) of one family's exposition."""
    text = generate_latest(_One(metric))
    cut = text.index(b"\n", text.index(b"\n") + 1) + 1
    return text[:cut], text[cut:]


def _samples(families: Iterable[Metric]) -> list[bytes]:
    return [_split(m)[1] for m in families]


@dataclass
class _Cached:
    version: int
    lines: list[bytes]  # per family, in family order


class Exposition:
    """The text of ``/metrics`` for one `RunRegistry`, re-rendering only what changed.

    Thread-safe; concurrent scrapes are serialised (each sees one consistent snapshot)."""

    def __init__(self, runs: RunRegistry) -> None:
        self.runs = runs
        self._collector = TimwatchCollector(runs)
        self._headers = [_split(m)[0] for m in self._collector.families([], None)]
        self._cache: dict[str, _Cached] = {}
        self._lock = threading.Lock()
        self.rendered_runs = 0  # runs rendered by the last call (what it cost)

    def _run_lines(self, state: RunState) -> list[bytes]:
        cached = self._cache.get(state.run)
        if cached is None or cached.version != state.version:
            cached = _Cached(state.version, _samples(self._collector.families([state], None)))
            self._cache[state.run] = cached
            self.rendered_runs += 1
        return cached.lines

    def render(self) -> bytes:
        """The exposition of the registry's current state (idle runs evicted first)."""
        with self._lock:
            states = self.runs.snapshot()
            rejected: Mapping[str, int] = self.runs.rejected()
            self.rendered_runs = 0
            per_run = [self._run_lines(s) for s in states]
            live = {s.run for s in states}
            for gone in [r for r in self._cache if r not in live]:
                del self._cache[gone]
            tail = _samples(
                self._collector.families(
                    [], rejected, self.runs.scalar_states(), self.runs.scalar_rejected()
                )
            )
            out: list[bytes] = []
            for k, header in enumerate(self._headers):
                out.append(header)
                out.extend(lines[k] for lines in per_run)
                out.append(tail[k])
            return b"".join(out)
