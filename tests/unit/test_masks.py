"""Mask policies: hypothesis properties and each policy against the literal rule of
docs/reference/policies.md.

Rules are checked at positions inside the loss mask; what a sequence policy writes at positions
outside it is not specified (docs/definitions.md) and not asserted here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from tests.helpers.reference import (
    POLICY_NAMES,
    SEQ_POLICIES,
    TOKEN_POLICIES,
    RefParams,
    keep_token,
    near_boundary,
    seq_keep,
    seq_near_boundary,
)
from tests.helpers.reference import k3 as ref_k3
from timwatch.monitor.core import masks, rs_modes
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.row import derive_row

SETTINGS = settings(max_examples=60, deadline=None)
logp = st.floats(min_value=-60.0, max_value=0.0, allow_nan=False)
ent = st.floats(min_value=0.0, max_value=15.0, allow_nan=False)


@st.composite
def token_arrays(draw: st.DrawFn, max_n: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = draw(st.integers(1, max_n))
    lt = draw(st.lists(logp, min_size=n, max_size=n))
    lr = draw(st.lists(logp, min_size=n, max_size=n))
    h = draw(st.lists(ent, min_size=n, max_size=n))
    return np.array(lt), np.array(lr), np.array(h)


@st.composite
def packed(draw: st.DrawFn) -> dict[str, np.ndarray]:
    lengths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=8))
    assume(sum(lengths) > 0)
    n = sum(lengths)
    lt, lr, h = (np.array(draw(st.lists(s, min_size=n, max_size=n))) for s in (logp, logp, ent))
    # Small |δ| too, so that the narrow sequence windows (geo_rs ±0.1 %) keep some sequences.
    scale = draw(st.sampled_from([1.0, 1e-3, 1e-5]))
    lt = np.minimum(lr + (lt - lr) * scale, 0.0)
    mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.int64)
    return {
        "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "logp_train": lt,
        "logp_rollout": lr,
        "entropy": h,
        "loss_mask": mask,
    }


def token_call(name: str, lt, lr, h, p: RefParams):  # type: ignore[no-untyped-def]
    if name == "estr":
        return masks.estr_keep_mask(lt, lr, h, tau=p.tau, eps=p.eps)
    if name == "delta_abs":
        return masks.delta_abs_keep_mask(lt, lr, tau=p.tau, C=p.delta_abs_c)
    if name == "icepop":
        return masks.icepop_keep_mask(lt, lr, low=p.icepop_low, high=p.icepop_high)
    if name == "kpop":
        return masks.kpop_keep_mask(lt, lr, phi=p.kpop_phi)
    if name == "tis":
        return masks.tis_keep_mask(lt, lr, c=p.tis_c)
    if name == "token_k1":
        return rs_modes.token_k1_keep_mask(lt, lr, p.token_k1_lower, p.token_k1_upper)
    if name == "token_k2":
        return rs_modes.token_k2_keep_mask(lt, lr, p.token_k2_upper)
    if name == "token_k3":
        return rs_modes.token_k3_keep_mask(lt, lr, p.token_k3_upper)
    raise ValueError(name)


def seq_call(name: str, lt, lr, cu, mask, p: RefParams):  # type: ignore[no-untyped-def]
    if name == "seq_mis":
        return masks.seq_mis_keep_mask(lt, lr, cu, mask, low=p.seq_mis_low, high=p.seq_mis_high)
    if name == "geo_rs":
        return masks.geo_rs_keep_mask(lt, lr, cu, mask, low=p.geo_rs_low, high=p.geo_rs_high)
    if name == "k3_rs":
        return masks.k3_rs_keep_mask(lt, lr, cu, mask, kappa=p.k3_rs_kappa)
    fn = getattr(rs_modes, f"{name}_keep_mask")
    return fn(lt, lr, cu, mask, getattr(p, f"{name}_upper"))


params_st = st.builds(
    RefParams,
    tau=st.floats(0.05, 5.0),
    eps=st.floats(1e-4, 0.1),
    delta_abs_c=st.floats(0.01, 10.0),
    icepop_low=st.floats(0.1, 0.99),
    icepop_high=st.floats(1.01, 10.0),
    kpop_phi=st.floats(1e-3, 3.0),
    tis_c=st.floats(1.0, 5.0),
    seq_mis_low=st.floats(0.1, 0.99),
    seq_mis_high=st.floats(1.01, 5.0),
    geo_rs_low=st.floats(0.99, 0.9999),
    geo_rs_high=st.floats(1.0001, 1.01),
    k3_rs_kappa=st.floats(1e-6, 1.0),
    token_k1_lower=st.floats(0.1, 0.99),
    token_k1_upper=st.floats(1.01, 10.0),
    token_k2_upper=st.floats(1e-6, 5.0),
    token_k3_upper=st.floats(1e-6, 5.0),
    seq_sum_k2_upper=st.floats(1e-6, 5.0),
    seq_sum_k3_upper=st.floats(1e-6, 5.0),
    seq_mean_k2_upper=st.floats(1e-6, 1.0),
    seq_max_k2_upper=st.floats(1e-6, 5.0),
    seq_max_k3_upper=st.floats(1e-6, 5.0),
)


def test_policy_registry() -> None:
    assert tuple(masks.POLICIES) == POLICY_NAMES
    p = masks.PolicyParams()
    want = dataclasses.asdict(RefParams())
    assert {k: getattr(p, k) for k in want} == want  # the documented defaults


# ---- k3 ≥ 0 ---------------------------------------------------------------------------------


@SETTINGS
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50))
@example([0.0, 1e-4, -1e-4, 1e-9, -1e-9, 20.0, -20.0, 700.0, -700.0, 5e-324])
def test_k3_nonnegative_and_accurate(ds: list[float]) -> None:
    d = np.array(ds)
    got = np.asarray(masks.token_k3(np.clip(d, -20.0, 20.0)))
    assert (got >= 0).all()
    want = np.array([ref_k3(x) for x in ds])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0.0)
    assert (np.asarray(masks.token_k3(d)) >= 0).all()  # unclamped input too


@SETTINGS
@given(packed())
def test_engine_kl_nonnegative(arrays: dict[str, np.ndarray]) -> None:
    arrays = arrays | {"logp_old": np.minimum(arrays["logp_rollout"] * 0.5, 0.0)}
    row = derive_row(accumulate(Batch.from_arrays(**arrays))).to_dict()
    for name in ("mismatch_kl", "discrepancy_kl", "staleness_kl"):
        assert row[name] is None or row[name] >= 0, name
    assert all(b["mismatch_kl"] >= 0 for b in row["length_buckets"].values())


# ---- ESTR vs delta_abs, monotonicity --------------------------------------------------------


def _one(logp_rollout: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array([0.0]), np.array([logp_rollout]), np.zeros(1)


@SETTINGS
@given(
    arrs=token_arrays(),
    tau=st.floats(0.05, 5.0),
    big_c=st.floats(0.02, 10.0),
    eps=st.floats(1e-4, 0.01),
)
# δ = fl(√(τC)) where δ² rounds above τC: |δ| ≤ √(τC) and δ² ≤ τC disagree by one ulp here.
@example(arrs=_one(-0.8366600265340756), tau=0.7, big_c=1.0, eps=0.01)
@example(arrs=_one(-1.5811388300841898), tau=2.5, big_c=1.0, eps=0.01)
@example(arrs=_one(-1.2649110640673518), tau=1.6, big_c=1.0, eps=0.01)
def test_estr_with_constant_entropy_is_delta_abs(
    arrs: tuple[np.ndarray, np.ndarray, np.ndarray], tau: float, big_c: float, eps: float
) -> None:
    lt, lr, _ = arrs
    assume((big_c - eps) + eps == big_c)  # so that H + ε is exactly C
    h = np.full_like(lt, big_c - eps)
    estr = np.asarray(masks.estr_keep_mask(lt, lr, h, tau=tau, eps=eps))
    dabs = np.asarray(masks.delta_abs_keep_mask(lt, lr, tau=tau, C=big_c))
    np.testing.assert_array_equal(estr, dabs)


@SETTINGS
@given(arrs=token_arrays(), t1=st.floats(0.0, 5.0), t2=st.floats(0.0, 5.0))
def test_estr_keep_set_shrinks_as_tau_falls(
    arrs: tuple[np.ndarray, np.ndarray, np.ndarray], t1: float, t2: float
) -> None:
    lt, lr, h = arrs
    lo, hi = sorted((t1, t2))
    keep_lo = np.asarray(masks.estr_keep_mask(lt, lr, h, tau=lo))
    keep_hi = np.asarray(masks.estr_keep_mask(lt, lr, h, tau=hi))
    assert not (keep_lo & ~keep_hi).any()
    dl = np.asarray(masks.delta_abs_keep_mask(lt, lr, tau=lo))
    dh = np.asarray(masks.delta_abs_keep_mask(lt, lr, tau=hi))
    assert not (dl & ~dh).any()


# ---- each policy vs the literal rule --------------------------------------------------------


@SETTINGS
@given(arrs=token_arrays(), p=params_st)
def test_token_policies_match_rule(
    arrs: tuple[np.ndarray, np.ndarray, np.ndarray], p: RefParams
) -> None:
    lt, lr, h = arrs
    for name in TOKEN_POLICIES:
        got = np.asarray(token_call(name, lt, lr, h, p))
        assert got.dtype == np.bool_ and got.shape == lt.shape, name
        for i, (a, b, c) in enumerate(zip(lt, lr, h, strict=True)):
            if name in ("estr", "delta_abs") or not near_boundary(name, a, b, c, p):
                assert bool(got[i]) == keep_token(name, a, b, c, p), (name, i)
    w = np.asarray(masks.tis_weights(lt, lr, c=p.tis_c))
    want_w = [
        min(math.exp(min(max(a - b, -20.0), 20.0)), p.tis_c) for a, b in zip(lt, lr, strict=True)
    ]
    np.testing.assert_allclose(w, want_w, rtol=1e-12, atol=4.5e-16)


@SETTINGS
@given(arrays=packed(), p=params_st)
def test_sequence_policies_match_rule(arrays: dict[str, np.ndarray], p: RefParams) -> None:
    lt, lr, cu, mask = (
        arrays[k] for k in ("logp_train", "logp_rollout", "cu_seqlens", "loss_mask")
    )
    for name in SEQ_POLICIES:
        got = np.asarray(seq_call(name, lt, lr, cu, mask, p))
        assert got.dtype == np.bool_ and got.shape == lt.shape, name
        for s in range(len(cu) - 1):
            on = [i for i in range(cu[s], cu[s + 1]) if mask[i] == 1]
            if not on:
                continue
            deltas = [lt[i] - lr[i] for i in on]
            assert len(set(got[on].tolist())) == 1, (name, s)  # all or nothing
            if not seq_near_boundary(name, deltas, p):
                assert bool(got[on[0]]) == seq_keep(name, deltas, p), (name, s)


@SETTINGS
@given(arrays=packed(), p=params_st)
def test_keep_masks_agree_with_functions_and_row(
    arrays: dict[str, np.ndarray], p: RefParams
) -> None:
    batch = Batch.from_arrays(**arrays)
    pp = masks.PolicyParams(**dataclasses.asdict(p))
    km = masks.keep_masks(batch, masks.POLICIES, pp)
    assert set(km) == set(POLICY_NAMES)
    lt, lr, h, cu, mask = (
        arrays[k] for k in ("logp_train", "logp_rollout", "entropy", "cu_seqlens", "loss_mask")
    )
    on = mask == 1
    row = derive_row(accumulate(batch, params=pp)).to_dict()
    for name in POLICY_NAMES:
        direct = (
            token_call(name, lt, lr, h, p)
            if name in TOKEN_POLICIES
            else seq_call(name, lt, lr, cu, mask, p)
        )
        np.testing.assert_array_equal(np.asarray(km[name])[on], np.asarray(direct)[on], name)
        rejected = int((~np.asarray(km[name])[on]).sum())
        want = rejected / int(on.sum()) if on.any() else None
        assert row["mask_ratio"][name] == want, name


# ---- numpy and torch give identical masks ---------------------------------------------------


@SETTINGS
@given(arrays=packed(), p=params_st, dtype=st.sampled_from(["float32", "float64"]))
def test_numpy_and_torch_identical(arrays: dict[str, np.ndarray], p: RefParams, dtype: str) -> None:
    npd = {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in arrays.items()}
    tdd = {k: torch.from_numpy(v.copy()) for k, v in npd.items()}
    for name in POLICY_NAMES:
        if name in TOKEN_POLICIES:
            a = token_call(name, npd["logp_train"], npd["logp_rollout"], npd["entropy"], p)
            b = token_call(name, tdd["logp_train"], tdd["logp_rollout"], tdd["entropy"], p)
        else:
            args = ("logp_train", "logp_rollout", "cu_seqlens", "loss_mask")
            a = seq_call(name, *(npd[k] for k in args), p)
            b = seq_call(name, *(tdd[k] for k in args), p)
        assert isinstance(a, np.ndarray) and isinstance(b, torch.Tensor), name
        assert b.dtype == torch.bool, name
        np.testing.assert_array_equal(a, b.numpy(), err_msg=name)
    wa = masks.tis_weights(npd["logp_train"], npd["logp_rollout"], c=p.tis_c)
    wb = masks.tis_weights(tdd["logp_train"], tdd["logp_rollout"], c=p.tis_c)
    np.testing.assert_allclose(np.asarray(wa, dtype=np.float64), wb.double().numpy(), rtol=1e-6)
