"""Prefill probe → ``<run>-prefill-probe`` batches: parsing the probe answer (SGLang 0.5.x
input-side lists, see ``tests/helpers/fake_sglang.py``), packing and the forwarder's batching rules.

The end-to-end path (real proxy command, stand-in SGLang, real monitor) is in
``tests/stack/test_e2e_sidecar.py``; these are the units, each checked against hand-built values.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.helpers.fake_sglang as fake
from timwatch.monitor.core.batch import Batch
from timwatch.sidecar.proxy.records import RolloutRecord
from timwatch.sidecar.proxy.sglang.probe import ProbeResult, parse_probe_answer
from timwatch.sidecar.proxy.sglang.probe_forward import ProbeForwarder, pack
from timwatch.sidecar.proxy.sglang.wire import WireError


def _record(prompt: list[int], ids: list[int], versions: list[str]) -> RolloutRecord:
    logp = [fake.distribution(prompt + ids[:t])[tok] for t, tok in enumerate(ids)]
    return RolloutRecord("r1", tuple(prompt), tuple(ids), tuple(logp), tuple(versions), "stop", "7")


def _answer(prompt: list[int], ids: list[int], k: int, version: str = "7") -> dict[str, Any]:
    """A probe answer as SGLang 0.5.x writes it (built here by hand, not by the stand-in)."""
    seq = prompt + ids
    inp: list[list[Any]] = [[None, seq[0], None]]
    top: list[Any] = [None]
    for j in range(1, len(seq)):
        dist = fake.prefill_distribution(seq[:j])
        inp.append([dist[seq[j]], seq[j], None])
        order = sorted(range(fake.VOCAB), key=lambda t: -dist[t])[:k]
        top.append([[dist[t], t, None] for t in order])
    meta = {
        "id": "probe",
        "finish_reason": {"type": "length", "length": 0},
        "weight_version": version,
        "input_token_logprobs": inp,
        "output_token_logprobs": [],
        "input_top_logprobs": top,
        "output_top_logprobs": [],
    }
    return {"text": "", "output_ids": [], "meta_info": meta}


def test_parse_probe_answer_pairs_decode_prefill_and_bounds_entropy() -> None:
    prompt, ids = [4, 2, 9], [11, 3, 40, 5]
    rec = _record(prompt, ids, ["7"] * 4)
    result = parse_probe_answer(rec, _answer(prompt, ids, k=3))
    assert result.same_version and result.logp_decode == tuple(rec.logp.tolist())
    assert result.entropy_prefill is not None
    for t, tok in enumerate(ids):
        dist = fake.prefill_distribution(prompt + ids[:t])
        assert result.logp_prefill[t] == dist[tok]
        p = sorted((math.exp(x) for x in dist), reverse=True)[:3]
        lower = -sum(q * math.log(q) for q in p) - (1 - sum(p)) * math.log(p[2])
        assert result.entropy_prefill[t] == pytest.approx(lower, abs=1e-12)
        assert result.entropy_prefill[t] < fake.entropy(dist)


def test_parse_probe_answer_errors_name_the_field() -> None:
    prompt, ids = [4, 2], [7, 8]
    rec = _record(prompt, ids, ["7", "7"])
    short = _answer(prompt, ids, k=2)
    short["meta_info"]["input_top_logprobs"].pop()
    with pytest.raises(WireError, match=r"meta_info\.input_top_logprobs: expected 4 rows"):
        parse_probe_answer(rec, short)
    bad = _answer(prompt, ids, k=2)
    bad["meta_info"]["input_top_logprobs"][3][1][0] = "x"
    with pytest.raises(WireError, match=r"input_top_logprobs\[3\]\[1\]\[0\]"):
        parse_probe_answer(rec, bad)
    other = _answer(prompt, [7, 9], k=2)
    with pytest.raises(WireError, match=r"input_token_logprobs\[3\]"):
        parse_probe_answer(rec, other)
    no_top = _answer(prompt, ids, k=2)
    del no_top["meta_info"]["input_top_logprobs"]
    assert parse_probe_answer(rec, no_top).entropy_prefill is None


def _result(rid: str, n: int, versions: list[str | None], prefill_version: str | None,
            base: float = -1.0) -> ProbeResult:  # fmt: skip
    return ProbeResult(
        rid=rid,
        output_ids=tuple(range(n)),
        logp_decode=tuple(base - 0.1 * t for t in range(n)),
        logp_prefill=tuple(base - 0.1 * t + 0.01 for t in range(n)),
        versions=tuple(versions),
        prefill_weight_version=prefill_version,
        entropy_prefill=tuple(0.5 + t for t in range(n)),
    )


def test_pack_groups_by_prefill_version_and_keeps_versions_when_integer() -> None:
    a = _result("a", 2, ["step-7", "step-7"], "step-8")
    b = _result("b", 3, ["step-8"] * 3, "step-8", base=-2.0)
    c = _result("c", 1, ["default"], "default")
    batches = {bt.policy_version: bt for bt in pack([a, b, c])}
    assert set(batches) == {8, None}
    eight = batches[8]
    assert eight.rids == ["a", "b"]
    np.testing.assert_array_equal(eight.arrays["cu_seqlens"], [0, 2, 5])
    np.testing.assert_array_equal(eight.arrays["versions"], [7, 7, 8, 8, 8])
    np.testing.assert_array_equal(eight.arrays["token_ids"], [0, 1, 0, 1, 2])
    np.testing.assert_array_equal(eight.arrays["logp_rollout"], a.logp_decode + b.logp_decode)
    np.testing.assert_array_equal(eight.arrays["logp_train"], a.logp_prefill + b.logp_prefill)
    np.testing.assert_array_equal(eight.arrays["entropy"], [0.5, 1.5, 0.5, 1.5, 2.5])
    assert "versions" not in batches[None].arrays  # "default" is no number
    batch = Batch.from_arrays(**eight.arrays, policy_version=8, step=8, entropy_source="topk")
    assert batch.num_tokens == 5


class Reports:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, Any]]] = []
        self.event = threading.Event()

    def __call__(self, step: int, **kw: Any) -> None:
        self.calls.append((step, kw))
        self.event.set()


def test_forwarder_ships_every_n_results_from_its_thread() -> None:
    reports = Reports()
    fwd = ProbeForwarder(reports, batch_size=3, flush_s=3600.0)
    fwd.start()
    try:
        fwd.add(_result("a", 2, ["3", "3"], "3"))
        fwd.add(_result("b", 2, ["3", "3"], "3"))
        assert not reports.calls and fwd.stats()["buffered"] == 2
        fwd.add(_result("c", 1, ["2"], "3"))  # decoded at 2, scored at 3: still goes in
        assert reports.event.wait(10)
    finally:
        fwd.close()
    ((step, kw),) = reports.calls
    assert step == 3 and kw["policy_version"] == 3 and kw["entropy_source"] == "topk"
    np.testing.assert_array_equal(kw["versions"], [3, 3, 3, 3, 2])
    stats = fwd.stats()
    assert stats["sequences"] == 3 and stats["tokens"] == 5 and stats["stale_sequences"] == 1


def test_forwarder_flushes_after_flush_s_and_on_close_and_counts_unusable() -> None:
    now = [100.0]
    reports = Reports()
    fwd = ProbeForwarder(reports, batch_size=100, flush_s=5.0, clock=lambda: now[0])
    fwd.add(_result("a", 2, ["default"] * 2, "default"))
    assert not fwd._due()
    now[0] += 5.0
    assert fwd._due()
    assert fwd.flush() == 1
    fwd.add(_result("b", 1, ["default"], "default"))
    fwd.add(ProbeResult("e", (), (), (), (), "default"))
    fwd.add(ProbeResult("n", (1,), (-1.0,), (-1.0,), ("1",), "1"))  # no top-k entropy
    fwd.add(ProbeResult("f", (1,), (-1.0,), (-math.inf,), ("1",), "1", (0.1,)))
    fwd.close()
    assert [s for s, _ in reports.calls] == [0, 1]  # non-integer version: a counter
    assert all(kw["policy_version"] is None for _, kw in reports.calls)
    stats = fwd.stats()
    assert (stats["empty"], stats["no_entropy"], stats["nonfinite"]) == (1, 1, 1)
    assert stats["results"] == 5 and stats["sequences"] == 2 and stats["buffered"] == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.sampled_from(["1", "2", "step-3", "x"])),
        min_size=1,
        max_size=12,
    )
)
def test_pack_keeps_every_token_once_in_order(spec: list[tuple[int, str]]) -> None:
    results = [_result(f"r{i}", n, [v] * n, v, base=-float(i + 1)) for i, (n, v) in enumerate(spec)]
    batches = pack(results)
    assert sum(len(b.rids) for b in batches) == len(results)
    by_rid = {r.rid: r for r in results}
    for b in batches:
        cu = b.arrays["cu_seqlens"]
        for s, rid in enumerate(b.rids):
            got = b.arrays["logp_rollout"][cu[s] : cu[s + 1]]
            np.testing.assert_array_equal(got, by_rid[rid].logp_decode)
        order = [int(r[1:]) for r in b.rids]
        assert order == sorted(order)
