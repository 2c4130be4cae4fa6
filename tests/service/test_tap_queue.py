"""The trainer tap's bounded queue and how its drops are logged and reported to the monitor.

Uses `tests.helpers.tap_standin.StandIn` (a server that answers from a script and records each
request): a monitor that hangs on demand is what fills the queue, and the recorded headers show
what the tap tells the monitor about its drops.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest

from tests.helpers.tap_standin import StandIn
from timwatch.sidecar.tap import Tap
from timwatch.sidecar.tap.shipper import DROPPED_HEADER

N = 1000
SIZE = 16 + 13 * N  # cu_seqlens (2 × int64) + 3 float32 arrays + an int8 mask


def fixed(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "cu_seqlens": np.array([0, N], np.int64),
        "logp_rollout": -rng.random(N, np.float32),
        "logp_train": -rng.random(N, np.float32),
        "entropy": rng.random(N, np.float32),
        "loss_mask": np.ones(N, np.int8),
    }


def tap_of(url: str, **kw: Any) -> Tap:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("max_backoff_s", 0.05)
    kw.setdefault("finish", False)
    return Tap(url, "q", rank=0, **kw)


def until_arrived(stand_in: StandIn, n: int = 1) -> None:
    """Wait (bounded) until `n` requests reached the stand-in (which then hangs on its gate)."""
    deadline = time.monotonic() + 10
    while stand_in.arrived < n:
        assert time.monotonic() < deadline, stand_in.arrived
        time.sleep(0.01)


def dropped_headers(stand_in: StandIn) -> list[str | None]:
    return [r["headers"].get(DROPPED_HEADER) for r in stand_in.batches()]


def test_the_queue_is_bounded_by_bytes_and_drops_the_oldest(stand_in: StandIn) -> None:
    stand_in.gate.clear()  # the monitor hangs
    tap = tap_of(stand_in.url, queue_size=100, max_queue_bytes=3 * SIZE + SIZE // 2)
    assert tap.report(0, **fixed(0))
    until_arrived(stand_in)
    for step in range(1, 8):
        assert tap.report(step, **fixed(step))
    st = tap.stats()
    assert (st["queue"], st["queue_bytes"], st["dropped"], st["oversized"]) == (3, 3 * SIZE, 4, 0)
    stand_in.gate.set()
    assert tap.close(10)
    assert [r["batch"].step for r in stand_in.batches()] == [0, 5, 6, 7]
    assert tap.stats()["queue_bytes"] == 0


def test_a_batch_larger_than_the_budget_is_dropped_not_queued(
    stand_in: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    tap = tap_of(stand_in.url, max_queue_bytes=SIZE - 1)
    with caplog.at_level(logging.WARNING, logger="timwatch.tap"):
        assert tap.report(1, **fixed(1)) is False  # arrays: refused before any copy
        lists = {k: v.tolist() for k, v in fixed(2).items()}
        assert tap.report(2, **lists) is False  # lists: sized after the copy, then refused
        assert tap.close(10)
    st = tap.stats()
    assert (st["dropped"], st["oversized"], st["reported"], st["queue_bytes"]) == (2, 2, 0, 0)
    assert stand_in.batches() == []
    assert any("dropped 1 batch" in r.getMessage() for r in caplog.records)


def test_the_next_accepted_post_carries_the_drops_and_resets_them(stand_in: StandIn) -> None:
    stand_in.gate.clear()
    stand_in.script = [(200, {}), (503, {"Retry-After": "0"}), (200, {}), (200, {})]
    tap = tap_of(stand_in.url, queue_size=1)
    tap.report(0, **fixed(0))
    until_arrived(stand_in)  # step 0's headers are sent: the drops below come after them
    for step in range(1, 5):  # each one displaces the previous: 1, 2, 3 are dropped
        tap.report(step, **fixed(step))
    assert tap.stats()["unreported_drops"] == 3
    stand_in.gate.set()
    assert tap.flush(10)
    tap.report(5, **fixed(5))
    assert tap.close(10)
    # step 0 went out before any drop; step 4's 503 keeps the count for its retry; then reset
    assert [r["batch"].step for r in stand_in.batches()] == [0, 4, 4, 5]
    assert dropped_headers(stand_in) == [None, "3", "3", None]
    assert tap.stats()["unreported_drops"] == 0


def test_drops_ride_on_until_the_monitor_counts_them(stand_in: StandIn) -> None:
    replay = {"replayed": True}
    stand_in.gate.clear()
    stand_in.script = [
        (200, {}),  # step 0
        (200, {}, replay),  # step 2, first attempt, a replay: the monitor counted nothing
        (500, {}),  # step 3, first attempt
        (200, {}, replay),  # step 3, retry: the first attempt was stored (and counted)
        (200, {}),  # step 4
    ]
    tap = tap_of(stand_in.url, queue_size=1)
    tap.report(0, **fixed(0))
    until_arrived(stand_in)
    tap.report(1, **fixed(1))
    tap.report(2, **fixed(2))  # drops step 1
    stand_in.gate.set()
    assert tap.flush(10)
    tap.report(3, **fixed(3))
    assert tap.flush(10)
    tap.report(4, **fixed(4))
    assert tap.close(10)
    assert [r["batch"].step for r in stand_in.batches()] == [0, 2, 3, 3, 4]
    assert dropped_headers(stand_in) == [None, "1", "1", "1", None]


def test_batches_given_up_after_retries_count_as_dropped(stand_in: StandIn) -> None:
    stand_in.script = [(503, {}), (503, {})]  # step 1: both attempts fail
    tap = tap_of(stand_in.url, max_retries=1)
    tap.report(1, **fixed(1))
    assert tap.flush(10)
    assert tap.stats()["failed"] == tap.stats()["unreported_drops"] == 1
    tap.report(2, **fixed(2))
    assert tap.close(10)
    assert dropped_headers(stand_in) == [None, None, "1"]
    assert tap.stats()["unreported_drops"] == 0


def test_drop_warnings_are_rate_limited_and_none_is_lost(
    stand_in: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    stand_in.gate.clear()
    tap = tap_of(stand_in.url, queue_size=1, drop_log_s=3600)
    with caplog.at_level(logging.WARNING, logger="timwatch.tap"):
        tap.report(0, **fixed(0))
        until_arrived(stand_in)
        for step in range(1, 7):  # 5 drops
            tap.report(step, **fixed(step))
        warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(warned) == 1 and "dropped 1 batch" in warned[0]
        stand_in.gate.set()
        assert tap.close(10)
    warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warned) == 2 and "dropped 4 batch" in warned[1]  # the rest, at close
    assert "5 dropped in all" in warned[1]


def test_reused_copy_buffers_never_change_a_batch_that_is_still_queued(stand_in: StandIn) -> None:
    big = 100_000  # 400 kB float32 arrays: copied into pooled buffers

    def large(seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {
            "cu_seqlens": np.array([0, big // 2, big], np.int64),
            "logp_rollout": -rng.random(big, np.float32),
            "logp_train": -rng.random(big, np.float32),
            "entropy": rng.random(big, np.float32),
            "loss_mask": (rng.random(big) < 0.9).astype(np.int8),
            "token_ids": rng.integers(0, 50_000, big),
        }

    stand_in.gate.clear()
    tap = tap_of(stand_in.url, queue_size=2)
    tap.report(0, **large(0))
    until_arrived(stand_in)
    for step in range(1, 8):  # each report reuses the buffers of the batch it displaced
        tap.report(step, **large(step))
    stand_in.gate.set()
    assert tap.flush(10)
    for step in range(8, 12):  # shipped batches give their buffers back too
        tap.report(step, **large(step))
        assert tap.flush(10)
    assert tap.close(10)
    got = {r["batch"].step: r["batch"] for r in stand_in.batches()}
    assert sorted(got) == [0, 6, 7, 8, 9, 10, 11]
    for step, batch in got.items():
        for name, value in large(step).items():
            assert np.array_equal(batch.arrays()[name], value), (step, name)
