"""The join of trainer reports with captured rollout records
(`timwatch.sidecar.proxy.join.joiner.Joiner`).

Records are built by hand; the forwarded arrays are checked position by position and, through
the real engine, for the TITO drift metric they must produce.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.row import derive_row
from timwatch.sidecar.proxy.capture import CaptureStore
from timwatch.sidecar.proxy.join.joiner import Joiner, JoinError
from timwatch.sidecar.proxy.records import RolloutRecord


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Sink:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, run, step, arrays, policy_version, batch_id, entropy_source) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(
            dict(
                run=run, step=step, arrays=arrays, policy_version=policy_version,
                batch_id=batch_id, entropy_source=entropy_source,
            )
        )  # fmt: skip


def record(
    rid: str, ids: list[int], *, version: str = "step-4", topk: bool = False
) -> RolloutRecord:
    n = len(ids)
    return RolloutRecord(
        rid=rid,
        input_ids=(1, 2, 3),
        output_ids=tuple(ids),
        logp=tuple(-0.1 * (i + 1) for i in range(n)),
        versions=tuple([version] * n),
        finish_reason="stop",
        weight_version=version,
        entropy_lower=tuple(0.5 + i for i in range(n)) if topk else None,
        entropy_tail=None,
        entropy_source="topk" if topk else None,
    )


def sample(rid: str | None, ids: list[int], **extra: Any) -> dict[str, Any]:
    n = len(ids)
    out: dict[str, Any] = {
        "token_ids": ids,
        "logp_train": [-0.1 * (i + 1) - 0.01 for i in range(n)],
    }
    out["entropy"] = [1.0] * n
    if rid is not None:
        out["rid"] = rid
    out.update(extra)
    return out


def make(**kw: Any) -> tuple[CaptureStore, Sink, Joiner, Clock]:
    clock = Clock()
    store = CaptureStore(ttl_s=100.0, clock=clock)
    sink = Sink()
    return store, sink, Joiner(store, sink, default_run="r0", clock=clock, **kw), clock


def test_join_by_rid_fills_mu_ids_versions_and_detects_tito_drift() -> None:
    store, sink, joiner, _ = make()
    store.add(record("a", [10, 11, 12]))
    store.add(record("b", [20, 21], version="step-3"))
    ans = joiner.submit(
        {
            "step": 5,
            "policy_version": 4,
            "samples": [sample("a", [10, 99, 12]), sample("b", [20, 21], loss_mask=[1, 0])],
        }
    )
    assert ans["status"] == "forwarded" and ans["tokens"] == 5
    (call,) = sink.calls
    assert (call["run"], call["step"], call["policy_version"]) == ("r0", 5, 4)
    a = call["arrays"]
    assert a["cu_seqlens"].tolist() == [0, 3, 5]
    np.testing.assert_allclose(a["logp_rollout"], [-0.1, -0.2, -0.3, -0.1, -0.2])
    np.testing.assert_allclose(a["logp_train"], [-0.11, -0.21, -0.31, -0.11, -0.21])
    assert a["token_ids"].tolist() == [10, 11, 12, 20, 21]
    assert a["token_ids_train"].tolist() == [10, 99, 12, 20, 21]
    assert a["versions"].tolist() == [4, 4, 4, 3, 3]
    assert a["loss_mask"].tolist() == [1, 1, 1, 1, 0]
    assert call["entropy_source"] == "trainer"
    row = derive_row(accumulate(Batch.from_arrays(**a, policy_version=4))).to_dict()
    assert row["token_id_mismatch_ratio"] == pytest.approx(1 / 4)  # 1 of 4 masked positions
    assert row["version_lag_max"] == 1
    assert len(store) == 0 and joiner.counters["joined_samples"] == 2


def test_join_by_tokens_without_rid() -> None:
    store, sink, joiner, _ = make()
    store.add(record("x", [5, 6]))
    store.add(record("y", [7, 8, 9]))
    joiner.submit({"step": 1, "samples": [sample(None, [7, 8, 9])]})
    (call,) = sink.calls
    np.testing.assert_allclose(call["arrays"]["logp_rollout"], [-0.1, -0.2, -0.3])
    assert [r.rid for r in store.snapshot()] == ["x"]


def test_topk_entropy_used_when_the_trainer_sends_none() -> None:
    store, sink, joiner, _ = make(rollout_entropy=True)
    store.add(record("a", [1, 2], topk=True))
    s = sample("a", [1, 2])
    del s["entropy"]
    joiner.submit({"step": 2, "samples": [s]})
    (call,) = sink.calls
    assert call["entropy_source"] == "topk"
    np.testing.assert_allclose(call["arrays"]["entropy"], [0.5, 1.5])


def test_missing_entropy_without_topk_is_refused_before_consuming_records() -> None:
    store, sink, joiner, _ = make()
    store.add(record("a", [1, 2]))
    s = sample("a", [1, 2])
    del s["entropy"]
    with pytest.raises(JoinError) as e:
        joiner.submit({"step": 2, "samples": [sample("a", [1, 2]), s]})
    assert e.value.field == "samples[1].entropy"
    assert len(store) == 1 and sink.calls == []


def test_length_mismatch_joins_the_common_prefix_and_is_counted() -> None:
    store, sink, joiner, _ = make()
    store.add(record("a", [1, 2, 3, 4]))
    joiner.submit({"step": 1, "samples": [sample("a", [1, 2, 7])]})
    (call,) = sink.calls
    assert call["arrays"]["token_ids"].tolist() == [1, 2, 3]
    assert call["arrays"]["token_ids_train"].tolist() == [1, 2, 7]
    assert joiner.counters["length_mismatch"] == 1


def test_pending_report_completes_when_its_record_arrives() -> None:
    store, sink, joiner, clock = make(report_ttl_s=10.0)
    store.add(record("a", [1]))
    ans = joiner.submit({"step": 3, "samples": [sample("a", [1]), sample("late", [2, 3])]})
    assert ans["status"] == "pending" and ans["missing"] == ["late"]
    assert sink.calls == [] and joiner.counters["pending_reports"] == 1
    clock.t = 5.0
    store.add(record("late", [2, 3]))
    joiner.sweep()
    (call,) = sink.calls
    assert call["arrays"]["cu_seqlens"].tolist() == [0, 1, 3]  # report order, not arrival order
    assert joiner.counters["pending_reports"] == 0


def test_expired_report_forwards_what_joined_and_counts_the_rest() -> None:
    store, sink, joiner, clock = make(report_ttl_s=10.0)
    store.add(record("a", [1, 2]))
    joiner.submit({"step": 3, "samples": [sample("a", [1, 2]), sample("never", [4])]})
    clock.t = 9.9
    joiner.sweep()
    assert sink.calls == []
    clock.t = 10.0
    joiner.sweep()
    (call,) = sink.calls
    assert call["arrays"]["cu_seqlens"].tolist() == [0, 2]
    assert joiner.counters["expired_reports"] == 1
    assert joiner.counters["unjoined_samples"] == 1


def test_unclaimed_records_expire_in_the_store() -> None:
    store, _, joiner, clock = make()
    store.add(record("orphan", [1]))
    clock.t = 100.0
    joiner.sweep()
    assert store.expire() == 1 and store.counters.expired == 1


def test_replayed_report_with_batch_id_is_answered_not_rejoined() -> None:
    store, sink, joiner, _ = make()
    store.add(record("a", [1]))
    body = {"step": 1, "batch_id": "rep-1", "samples": [sample("a", [1])]}
    first = joiner.submit(body)
    again = joiner.submit(body)
    assert first["replayed"] is False and again["replayed"] is True
    assert again["tokens"] == first["tokens"] == 1
    assert len(sink.calls) == 1 and sink.calls[0]["batch_id"] == "rep-1"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "body"),
        ({"samples": [{"rid": "a", "logp_train": [-1.0]}]}, "step"),
        ({"step": -1, "samples": []}, "step"),
        ({"step": 1, "samples": []}, "samples"),
        ({"step": 1, "samples": [{"logp_train": [-1.0], "entropy": [1.0]}]}, "samples[0]"),
        ({"step": 1, "samples": [{"rid": "a", "entropy": [1.0]}]}, "samples[0].logp_train"),
        (
            {"step": 1, "samples": [{"rid": "a", "logp_train": [-1.0, "x"], "entropy": [1, 1]}]},
            "samples[0].logp_train",
        ),
        (
            {"step": 1, "samples": [{"rid": "a", "logp_train": [-1.0], "entropy": [1.0, 2.0]}]},
            "samples[0].entropy",
        ),
        (
            {
                "step": 1,
                "samples": [{"token_ids": [1, -2], "logp_train": [-1, -1], "entropy": [1, 1]}],
            },
            "samples[0].token_ids",
        ),
    ],
)
def test_malformed_reports_name_the_field(body: Any, field: str) -> None:
    _, sink, joiner, _ = make()
    with pytest.raises(JoinError) as e:
        joiner.submit(body)
    assert e.value.field == field
    assert field.split(".")[-1].split("[")[0] in str(e.value)
    assert sink.calls == []
