"""`records.version_runs` (run-length per-token versions, with a fast path for one span over
the whole answer) against one label per token, written here span by span."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from timwatch.sidecar.proxy.records import version_runs

_span = st.tuples(st.integers(0, 12), st.integers(0, 12), st.sampled_from(["a", "b", None])).map(
    lambda t: {"start": min(t[0], t[1]), "end": max(t[0], t[1]), "version": t[2]}
)


def _per_token(spans: list[dict], n: int, default: str | None) -> list[str | None]:
    labels = [default] * n
    for span in spans:
        for t in range(span["start"], min(span["end"], n)):
            labels[t] = span["version"]
    return labels


def _rle(labels: list[str | None]) -> tuple[tuple[str | None, int], ...]:
    return tuple((k, len(list(g))) for k, g in itertools.groupby(labels))


@settings(max_examples=300, deadline=None)
@given(st.lists(_span, max_size=4), st.integers(1, 10), st.sampled_from(["d", None]))
def test_runs_equal_the_per_token_labels(spans: list[dict], n: int, default: str | None) -> None:
    assert version_runs(spans, n, default) == _rle(_per_token(spans, n, default))


def test_one_span_over_the_whole_answer() -> None:
    spans = [{"start": 0, "end": 9, "version": "step-3"}]
    assert version_runs(spans, 7, "d") == (("step-3", 7),)
    assert version_runs([{"start": 0, "end": 5, "version": "v"}], 7, "d") == (("v", 5), ("d", 2))
    assert version_runs(None, 3, "d") == (("d", 3),)
