"""The engine's rows are bit for bit those of the engine before the speed work (git e8c9d4d).

The fixture holds that engine's rows and accumulator states as hex floats on awkward batches
(ragged, masked, empty and fully masked sequences, every optional input, JSON and float32
sources, non-default policies, two threads, FP16-level δ, top-k ties, δ at the series switch
and the clamp); `tests/helpers/engine_rows.py --rev e8c9d4d` regenerates it from that revision.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers.engine_rows import FIXTURE, current_rows, parity_cases


@pytest.fixture(scope="module")
def rows() -> tuple[dict[str, Any], dict[str, Any]]:
    return json.loads(FIXTURE.read_text()), current_rows()


def _diff(path: str, want: Any, got: Any, out: list[str]) -> None:
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            _diff(f"{path}.{k}", want.get(k, "<absent>"), got.get(k, "<absent>"), out)
    elif isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            _diff(f"{path}[{i}]", a, b, out)
    elif want != got:
        out.append(f"{path}: {want!r} != {got!r}")


@pytest.mark.parametrize("name", [c[0] for c in parity_cases()])
def test_rows_and_states_are_bit_identical(
    rows: tuple[dict[str, Any], dict[str, Any]], name: str
) -> None:
    want, got = rows
    diffs: list[str] = []
    _diff(name, want[name], got[name], diffs)
    assert not diffs, "\n".join(diffs[:20])


def test_fixture_covers_every_case_and_is_not_trivial(
    rows: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    want, _ = rows
    assert set(want) == {c[0] for c in parity_cases()}
    bench = want["bench_f32"]["row"]
    assert bench["mismatch_kl"].startswith("f:") and bench["tokens"] > 190_000
    assert len(bench["worst_tokens"]) == 16
    assert want["fully_masked"]["row"]["tokens"] == 0


def test_coarse_bins_of_the_walk_are_those_of_the_per_token_lookup() -> None:
    """The walk's coarse bins (a one-load bump for |δ|'s `le` buckets, counts of edges passed
    for the score's and for the left-closed heatmap grid) are those of the table-plus-edge
    lookup they replaced, and all are the bucket definitions, at every edge, one ulp either
    side of it, and across the whole range."""
    import numpy as np

    from timwatch.monitor.core.engine import _LAYOUTS, BIN_TABLES
    from timwatch.monitor.core.fastmath import fine_index
    from timwatch.monitor.core.histograms import (
        ABS_DELTA_LAYOUT,
        ESTR_SCORE_LAYOUT,
        HEATMAP_ABS_DELTA_TABLE,
        HEATMAP_ENTROPY_TABLE,
    )

    ad_table, ad_bump, s_edges, h_edges, hd_edges = BIN_TABLES
    assert (s_edges == ESTR_SCORE_LAYOUT.coarse_edges).all()
    rng = np.random.default_rng(3)
    cases = (
        (0, ABS_DELTA_LAYOUT.coarse_edges, ad_table, ad_bump),
        (4, s_edges, ESTR_SCORE_LAYOUT.coarse_table, None),
        (8, h_edges, HEATMAP_ENTROPY_TABLE, None),
        (0, hd_edges, HEATMAP_ABS_DELTA_TABLE, None),
    )
    for k, edges, table, bump in cases:
        xs = [0.0, 1e-300, 5e-324, 1e300]
        for e in edges:
            xs += [float(e), float(np.nextafter(e, 0.0)), float(np.nextafter(e, np.inf))]
        xs += list(10.0 ** rng.uniform(-12, 4, 2000))
        lo, octs, sub, last = (int(v) for v in _LAYOUTS[k : k + 4])
        for x in xs:
            fb = fine_index(x, lo, octs, sub, last)
            c = int(table[fb])
            if k != 8 and edges is not hd_edges:  # `le` buckets
                old = c + (c < edges.shape[0] and x > edges[c])
                new = c + (x > bump[fb]) if bump is not None else int(sum(x > e for e in edges))
                want = int(np.searchsorted(edges, x, side="left"))  # first edge >= x
            else:
                old = c + (c + 1 < edges.shape[0] and x >= edges[c + 1])
                new = int(sum(x >= e for e in edges[1:]))
                want = int(np.searchsorted(edges, x, side="right")) - 1  # left-closed cells
            assert old == new == want, (k, x, old, new, want)
