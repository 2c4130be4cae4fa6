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
