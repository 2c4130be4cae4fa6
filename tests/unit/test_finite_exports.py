"""No accepted finite batch makes an export Inf/NaN: for values drawn across the whole accepted
range (the floor and ceiling of `batch_checks` included, and any finite padding on masked-out
tokens), every float of the derived row and every sample of the exposition is finite."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from timwatch.monitor.core.batch import ENTROPY_MAX, LOGP_MAX, LOGP_MIN, Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.errors import BatchError
from timwatch.monitor.core.masks import EPS_MIN, PolicyParams
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.service.exporter import make_registry, render
from timwatch.monitor.service.runs import RunRegistry

logps = st.sampled_from([LOGP_MIN, LOGP_MAX, 0.0, -0.0, -1e-300, -20.0, -700.0, -745.5]) | (
    st.floats(LOGP_MIN, LOGP_MAX)
)
entropies = st.sampled_from([0.0, ENTROPY_MAX, 5e-324, 1e-300]) | st.floats(0.0, ENTROPY_MAX)
padding = st.sampled_from([-1.7976931348623157e308, -1e300, 0.0, -745.0])
ints = st.integers(0, 2**63 - 1)


@st.composite
def batches(draw: Any) -> Batch:
    n = draw(st.integers(1, 40))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))
    mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.uint8)
    arrays: dict[str, Any] = {"cu_seqlens": np.array([0, *cuts, n], dtype=np.int64)}
    for name in ("logp_rollout", "logp_train", "logp_old", "logp_teacher", "entropy"):
        kept = entropies if name == "entropy" else logps
        values = [draw(kept) if m else draw(padding if name != "entropy" else st.just(1e300))
                  for m in mask]  # fmt: skip
        arrays[name] = np.array(values, dtype=np.float64)
    arrays["loss_mask"] = mask
    pv = draw(ints)
    arrays["versions"] = np.array(
        draw(st.lists(st.integers(pv - (2**63 - 1), 2**63 - 1), min_size=n, max_size=n)),
        dtype=np.int64,
    )
    arrays["token_ids"] = np.array(draw(st.lists(ints, min_size=n, max_size=n)), dtype=np.int64)
    arrays["token_ids_train"] = arrays["token_ids"][::-1].copy()
    return Batch.from_arrays(step=draw(ints), policy_version=pv, **arrays)


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _floats(v)]
    if isinstance(value, (list, tuple)):
        return [f for v in value for f in _floats(v)]
    return []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=batches(), second=batches())
def test_every_export_is_finite(first: Batch, second: Batch) -> None:
    runs = RunRegistry()
    for step, batch in enumerate((first, second)):
        acc = accumulate(batch, PolicyParams())
        row = derive_row(acc).to_dict()
        bad = [f for f in _floats(row) if not math.isfinite(f)]
        assert not bad, row
        runs.observe("r", acc, row, step)
    text = render(make_registry(runs)).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("le") == "+Inf":
                continue
            assert math.isfinite(sample.value), sample


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logp_rollout", LOGP_MIN * 1.000001),
        ("logp_train", -1e308),
        ("logp_old", -1e6),
        ("logp_teacher", -1e300),
        ("entropy", ENTROPY_MAX * 1.000001),
        ("entropy", 1e308),
    ],
)
def test_out_of_bound_kept_tokens_are_refused_but_masked_ones_pass(
    field: str, value: float
) -> None:
    arrays: dict[str, Any] = {
        "cu_seqlens": [0, 3],
        "logp_rollout": [-1.0, -2.0, -0.5],
        "logp_train": [-1.1, -2.0, -0.4],
        "logp_old": [-1.0, -2.0, -0.5],
        "logp_teacher": [-1.0, -2.0, -0.5],
        "entropy": [1.0, 2.0, 0.5],
        "loss_mask": [1, 0, 1],
    }
    arrays[field] = list(arrays[field])
    arrays[field][1] = value  # masked out: any finite value is padding
    Batch.from_arrays(**{k: np.array(v) for k, v in arrays.items()})
    arrays[field][2] = value
    with pytest.raises(BatchError) as info:
        Batch.from_arrays(**{k: np.array(v) for k, v in arrays.items()})
    assert info.value.field == field and info.value.index == 2


@pytest.mark.parametrize("seq_len", [1, 7, 4096])
@pytest.mark.parametrize(
    ("mu", "pi", "h"),
    [(LOGP_MIN, LOGP_MAX, 0.0), (LOGP_MAX, LOGP_MIN, ENTROPY_MAX), (LOGP_MIN, LOGP_MIN, 0.0)],
)
@pytest.mark.parametrize("eps", [0.01, EPS_MIN])
def test_worst_case_sums_stay_finite_at_2_31_tokens(
    seq_len: int, mu: float, pi: float, h: float, eps: float
) -> None:
    """Every token at the extremes of the accepted range: each float sum, scaled from this
    batch's tokens to 2^31 tokens, is still far below float64's maximum."""
    n = 8192
    batch = Batch.from_arrays(
        cu_seqlens=np.arange(0, n + 1, seq_len).tolist() + ([n] if n % seq_len else []),
        logp_rollout=np.full(n, mu),
        logp_train=np.full(n, pi),
        entropy=np.full(n, h),
        loss_mask=np.ones(n, dtype=np.uint8),
    )
    acc = accumulate(batch, PolicyParams(eps=eps))
    scale = 2**31 / n
    assert np.all(np.isfinite(acc.fsum)) and np.all(np.isfinite(acc.fext))
    assert float(np.max(np.abs(acc.fsum))) * scale < 1e300


def test_an_eps_below_the_floor_is_refused() -> None:
    with pytest.raises(ValueError, match="eps must be"):
        PolicyParams(eps=EPS_MIN / 2)
