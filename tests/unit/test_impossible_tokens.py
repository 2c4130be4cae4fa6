"""Impossible tokens: one side gives the sampled token probability 0 (δ = ±∞).

A position where exactly one of ``logp_rollout`` and ``logp_train`` is -inf (e.g. processed
log-probs from an engine whose nucleus differs from the trainer's) is taken out of the loss mask
and every metric and counted in ``impossible_tokens``, instead of refusing the batch; both -inf,
+inf and NaN are still refused. Checked against hand-computed values and the float64 reference.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from tests.helpers.batches import random_batch
from tests.helpers.reference import reference
from tests.unit.test_engine import check_row, run_engine
from timwatch.monitor.core.batch import Batch, BatchError
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.row import derive_row

INF = math.inf


def _row(mu: list[float], pi: list[float], mask: list[int]) -> dict[str, object]:
    n = len(mu)
    batch = Batch.from_arrays(
        cu_seqlens=np.array([0, n]),
        logp_rollout=np.array(mu),
        logp_train=np.array(pi),
        entropy=np.full(n, 0.5),
        loss_mask=np.array(mask, dtype=np.uint8),
    )
    return derive_row(accumulate(batch)).to_dict()


def test_hand_case_counts_both_directions_and_keeps_the_rest_exact() -> None:
    row = _row([-1.0, -INF, -0.5, -2.0], [-1.2, -0.3, -INF, -2.0], [1, 1, 1, 1])
    assert row["impossible_tokens"] == 2
    assert row["tokens"] == 2  # the two possible tokens
    d = -0.2  # δ = π − μ of token 0; token 3 has δ = 0
    k3 = (math.exp(d) - 1 - d) / 2
    assert row["mismatch_kl"] == pytest.approx(k3, rel=1e-12)
    assert row["log_ratio_abs_max"] == pytest.approx(0.2, rel=1e-12)
    assert row["nonfinite_tokens"] == 0


def test_masked_out_impossible_tokens_are_not_counted() -> None:
    row = _row([-1.0, -INF], [-1.0, -0.1], [1, 0])
    assert row["impossible_tokens"] == 0 and row["tokens"] == 1


def test_a_batch_of_only_impossible_tokens_is_accepted() -> None:
    row = _row([-INF, -INF], [-0.1, -0.2], [1, 1])
    assert row["impossible_tokens"] == 2 and row["tokens"] == 0


@pytest.mark.parametrize(
    ("mu", "pi", "field", "what"),
    [
        (-INF, -INF, "logp_rollout", "-inf"),  # both sides 0: δ undefined
        (-1.0, INF, "logp_train", "+inf"),
        (math.nan, -1.0, "logp_rollout", "NaN"),
        (-INF, math.nan, "logp_rollout", "-inf"),  # the other side is no number either
    ],
)
def test_undefined_deltas_are_still_refused(mu: float, pi: float, field: str, what: str) -> None:
    with pytest.raises(BatchError, match=rf"{field}\[1\] is {re.escape(what)}") as info:
        Batch.from_arrays(
            cu_seqlens=np.array([0, 2]),
            logp_rollout=np.array([-1.0, mu]),
            logp_train=np.array([-1.0, pi]),
            entropy=np.array([0.1, 0.1]),
            loss_mask=np.array([1, 1], dtype=np.uint8),
        )
    assert info.value.field == field


def test_engine_matches_reference_with_impossible_tokens() -> None:
    rng = np.random.default_rng(77)
    for _ in range(4):
        raw = random_batch(rng, optional="all")
        mask = np.asarray(raw.arrays["loss_mask"])
        on, off = np.flatnonzero(mask == 1), np.flatnonzero(mask == 0)
        pick = rng.choice(on, size=min(4, on.size), replace=False)
        arrays = {k: np.array(v, copy=True) for k, v in raw.arrays.items()}
        for j, i in enumerate(pick):
            arrays["logp_rollout" if j % 2 else "logp_train"][i] = -INF
        if off.size:
            arrays["logp_rollout"][off[0]] = -INF  # masked out: neither counted nor refused
        dirty = dataclasses.replace(raw, arrays=arrays)
        got = run_engine(dirty)
        ref, sc = reference(arrays, policy_version=raw.policy_version)
        assert got["impossible_tokens"] == len(pick) == ref["impossible_tokens"]
        check_row(got, ref, sc)


def test_forwarded_batches_keep_their_impossible_tokens() -> None:
    """The tap validates a batch and ships its arrays: the -inf and the loss_mask of each
    impossible token go back on the wire, so the monitor counts what the tap counted."""
    from timwatch.sidecar.tap.wire import encode

    batch = Batch.from_arrays(
        cu_seqlens=np.array([0, 5]),
        logp_rollout=np.array([-1.0, -INF, -0.5, -INF, -0.2]),
        logp_train=np.array([-1.1, -0.4, -INF, -0.3, -0.2]),
        entropy=np.full(5, 0.3),
        loss_mask=np.array([1, 1, 1, 0, 1], dtype=np.uint8),
    )
    assert batch.impossible_tokens == 2
    assert np.asarray(batch.loss_mask).tolist() == [1, 0, 0, 0, 1]
    wire = batch.wire_arrays()
    assert wire["logp_rollout"].tolist() == [-1.0, -INF, -0.5, -INF, -0.2]
    assert wire["logp_train"].tolist() == [-1.1, -0.4, -INF, -0.3, -0.2]
    assert wire["loss_mask"].tolist() == [1, 1, 1, 0, 1]
    again = Batch.from_safetensors(batch.to_safetensors())
    assert again.impossible_tokens == 2
    body, size = encode(batch, "b-1")
    shipped = Batch.from_safetensors(b"".join(bytes(part) for part in body))
    assert len(b"".join(bytes(part) for part in body)) == size
    assert shipped.impossible_tokens == 2
    row = derive_row(accumulate(shipped)).to_dict()
    assert row["tokens"] == 2 and row["impossible_tokens"] == 2
