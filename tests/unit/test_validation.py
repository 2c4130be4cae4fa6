"""Malformed batches are refused with a BatchError naming the field and the first bad index.

Every case goes through JSON (``Batch.from_json``), and the per-token cases also through numpy
(``from_arrays``) and safetensors bytes built with the safetensors library; nothing may escape as
another exception type. Then: ``nonfinite="drop"`` drops and counts, and JSON ↔ safetensors ↔
arrays round-trips are lossless.
"""

from __future__ import annotations

import copy
import json
import math
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from tests.helpers.batches import random_batches
from timwatch.monitor.core.batch import Batch, BatchError
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.row import derive_row

# Two sequences, five tokens: cu_seqlens [0, 2, 5].
BASE: dict[str, Any] = {
    "cu_seqlens": [0, 2, 5],
    "logp_rollout": [-0.5, -1.0, -0.25, -2.0, -0.1],
    "logp_train": [-0.4, -1.1, -0.25, -1.5, -0.2],
    "entropy": [0.3, 0.0, 1.2, 2.0, 0.05],
    "loss_mask": [0, 1, 1, 1, 1],
    "token_ids": [11, 12, 13, 14, 15],
    "token_ids_train": [11, 12, 13, 14, 15],
    "versions": [7, 7, 6, 7, 7],
    "logp_old": [-0.45, -1.05, -0.3, -1.9, -0.15],
    "logp_teacher": [-0.1, -0.2, -3.0, -0.7, -0.01],
    "step": 3,
    "batch_id": "b-1",
    "policy_version": 7,
    "entropy_source": "trainer",
}
TOKEN_FIELDS = [k for k, v in BASE.items() if isinstance(v, list) and k != "cu_seqlens"]


def with_(**changes: Any) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    for k, v in changes.items():
        if v is _DROP:
            del obj[k]
        else:
            obj[k] = v
    return obj


_DROP = object()


def patched(field: str, index: int, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    obj[field][index] = value
    return obj


def expect(fn: Callable[[], Any], field: str, index: int | None = None, *words: str) -> BatchError:
    """Call fn; it must raise BatchError for `field` (at `index`), message naming both."""
    with pytest.raises(BatchError) as info:
        fn()
    err = info.value
    msg = str(err)
    assert err.field == field, msg
    assert field in msg, msg
    assert "np." not in msg, f"numpy repr leaked into the message: {msg}"
    if index is not None:
        assert err.index == index, msg
        assert f"{field}[{index}]" in msg, msg
    for w in words:
        assert w.lower() in msg.lower(), msg
    return err


def _both(a: str, b: str, i: int, value: float) -> dict[str, Any]:
    obj = patched(a, i, value)
    obj[b][i] = value
    return obj


# (id, JSON object, field, first bad index or None, words the message must contain)
CASES: list[tuple[str, dict[str, Any], str, int | None, tuple[str, ...]]] = [
    ("nan-rollout", patched("logp_rollout", 3, math.nan), "logp_rollout", 3, ("nan",)),
    ("pinf-train", patched("logp_train", 1, math.inf), "logp_train", 1, ("inf",)),
    # -inf on both sides: δ undefined (one side alone is an impossible token, accepted:
    # tests/unit/test_impossible_tokens.py)
    ("ninf-both", _both("logp_rollout", "logp_train", 4, -math.inf), "logp_rollout", 4, ("inf",)),
    ("nan-entropy", patched("entropy", 1, math.nan), "entropy", 1, ("nan",)),
    ("inf-entropy", patched("entropy", 0, math.inf), "entropy", 0, ("inf",)),
    ("positive-logp", patched("logp_rollout", 2, 0.5), "logp_rollout", 2, ()),
    ("positive-logp-2e-6", patched("logp_train", 0, 2e-6), "logp_train", 0, ()),
    ("positive-logp-old", patched("logp_old", 3, 0.1), "logp_old", 3, ()),
    ("nan-logp-teacher", patched("logp_teacher", 2, math.nan), "logp_teacher", 2, ("nan",)),
    ("negative-entropy", patched("entropy", 4, -0.1), "entropy", 4, ()),
    ("two-bad-first-wins", with_(entropy=[0.1, -1.0, 0.2, -3.0, 0.0]), "entropy", 1, ()),
    ("mask-2", patched("loss_mask", 3, 2), "loss_mask", 3, ()),
    ("mask-half", patched("loss_mask", 1, 0.5), "loss_mask", 1, ()),
    ("mask-neg", patched("loss_mask", 0, -1), "loss_mask", 0, ()),
    ("string-logp", patched("logp_rollout", 2, "abc"), "logp_rollout", 2, ()),
    ("null-logp", patched("logp_train", 1, None), "logp_train", 1, ()),
    ("float-cu", with_(cu_seqlens=[0, 2.5, 5]), "cu_seqlens", 1, ()),
    ("float-token-id", patched("token_ids", 3, 1.5), "token_ids", 3, ("= 1.5 must",)),
    ("negative-token-id", patched("token_ids_train", 1, -1), "token_ids_train", 1, ()),
    ("string-version", patched("versions", 2, "x"), "versions", 2, ()),
    ("cu-start", with_(cu_seqlens=[1, 2, 5]), "cu_seqlens", None, ("start", "1")),
    ("cu-not-monotone", with_(cu_seqlens=[0, 3, 2, 5]), "cu_seqlens", 2, ()),
    ("cu-end-short", with_(cu_seqlens=[0, 2, 4]), "cu_seqlens", None, ("5", "4")),
    ("cu-end-long", with_(cu_seqlens=[0, 2, 6]), "cu_seqlens", None, ("5", "6")),
    ("cu-empty", with_(cu_seqlens=[]), "cu_seqlens", None, ()),
    ("length-mismatch", with_(logp_train=[-0.1, -0.2, -0.3, -0.4]), "logp_train", None, ()),
    ("length-mismatch-opt", with_(versions=[1, 2, 3, 4, 5, 6]), "versions", None, ()),
    ("missing-entropy", with_(entropy=_DROP), "entropy", None, ()),
    ("missing-cu", with_(cu_seqlens=_DROP), "cu_seqlens", None, ()),
    ("unknown-field", with_(logp_foo=[0, 0, 0, 0, 0]), "logp_foo", None, ()),
    ("not-a-list", with_(logp_rollout=3.0), "logp_rollout", None, ()),
    ("nested-list", with_(logp_rollout=[[-0.1, -0.2]] * 5), "logp_rollout", None, ()),
    ("step-string", with_(step="abc"), "step", None, ()),
    ("step-float", with_(step=1.5), "step", None, ()),
    ("policy-version-string", with_(policy_version="v7"), "policy_version", None, ()),
    ("entropy-source", with_(entropy_source="magic"), "entropy_source", None, ()),
]


def test_case_count() -> None:
    assert len(CASES) >= 20


@pytest.mark.parametrize(
    ("obj", "field", "index", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_json_refused(
    obj: dict[str, Any], field: str, index: int | None, words: tuple[str, ...]
) -> None:
    expect(lambda: Batch.from_json(obj), field, index, *words)


def test_json_empty_batch() -> None:
    empty = {k: [] for k in TOKEN_FIELDS} | {"cu_seqlens": [0]}
    with pytest.raises(BatchError) as info:
        Batch.from_json(empty)
    assert "empty" in str(info.value).lower()
    with pytest.raises(BatchError):
        Batch.from_json(empty | {"cu_seqlens": [0, 0]})  # one empty sequence is still N = 0


@pytest.mark.parametrize("bad", [[], "x", 5, None])
def test_json_not_an_object(bad: Any) -> None:
    with pytest.raises(BatchError):
        Batch.from_json(bad)


def test_valid_base_and_boundaries_accepted() -> None:
    b = Batch.from_json(BASE)
    assert (b.num_tokens, b.num_sequences, b.step, b.batch_id) == (5, 2, 3, "b-1")
    # 1e-6 is the documented tolerance for positive log-probs; empty sequences are allowed.
    b = Batch.from_json(patched("logp_rollout", 0, 1e-6) | {"cu_seqlens": [0, 0, 2, 2, 5]})
    assert b.num_sequences == 4
    only = {
        k: BASE[k] for k in ("cu_seqlens", "logp_rollout", "logp_train", "entropy", "loss_mask")
    }
    b = Batch.from_json(only)
    assert (b.step, b.batch_id, b.policy_version, b.entropy_source) == (0, None, None, "trainer")


# ---- the same through numpy arrays and through safetensors --------------------------------

ARRAY_CASES = [c for c in CASES if c[3] is not None and not isinstance(c[1][c[2]][c[3]], str)]
ARRAY_CASES = [c for c in ARRAY_CASES if c[1][c[2]][c[3]] is not None]


def _np(obj: dict[str, Any], field: str) -> dict[str, np.ndarray]:
    out = {}
    for k, v in obj.items():
        if isinstance(v, list):
            if k == field:
                out[k] = np.asarray(v)  # keeps the bad dtype (float where int expected)
            elif k in ("cu_seqlens", "loss_mask", "token_ids", "token_ids_train", "versions"):
                out[k] = np.asarray(v, dtype=np.int64)
            else:
                out[k] = np.asarray(v, dtype=np.float64)
    return out


@pytest.mark.parametrize(
    ("obj", "field", "index", "words"),
    [c[1:] for c in ARRAY_CASES],
    ids=[c[0] for c in ARRAY_CASES],
)
def test_arrays_refused(
    obj: dict[str, Any], field: str, index: int, words: tuple[str, ...]
) -> None:
    meta = {k: v for k, v in obj.items() if not isinstance(v, list)}
    expect(lambda: Batch.from_arrays(**_np(obj, field), **meta), field, index, *words)


@pytest.mark.parametrize(
    ("obj", "field", "index", "words"),
    [c[1:] for c in ARRAY_CASES],
    ids=[c[0] for c in ARRAY_CASES],
)
def test_safetensors_refused(
    obj: dict[str, Any], field: str, index: int, words: tuple[str, ...]
) -> None:
    meta = {k: str(v) for k, v in obj.items() if not isinstance(v, list)}
    data = save(_np(obj, field), metadata=meta)
    with pytest.raises(BatchError) as info:
        Batch.from_safetensors(data)
    # A float tensor where ints belong may be refused for its dtype (no index) — still by name.
    assert info.value.field == field, str(info.value)
    if np.asarray(obj[field]).dtype.kind == "f" and field in (
        "cu_seqlens",
        "token_ids",
        "loss_mask",
    ):
        return
    assert info.value.index == index and f"{field}[{index}]" in str(info.value)


def test_error_at_large_index_names_it() -> None:
    rng = np.random.default_rng(5)
    n = 5120
    arrays = {
        "cu_seqlens": np.array([0, 1000, 3000, n]),
        "logp_rollout": -rng.exponential(1.0, n),
        "logp_train": -rng.exponential(1.0, n),
        "entropy": rng.exponential(1.0, n),
        "loss_mask": np.ones(n, dtype=np.int64),
    }
    arrays["logp_rollout"][[1043, 2000]] = np.nan
    err = expect(lambda: Batch.from_arrays(**arrays), "logp_rollout", 1043, "nan")
    assert "logp_rollout[1043] is NaN" in str(err)
    arrays["logp_rollout"][[1043, 2000]] = -1.0
    arrays["cu_seqlens"] = np.array([0, 1000, 3000, n - 1])
    err = expect(lambda: Batch.from_arrays(**arrays), "cu_seqlens")
    assert "5120" in str(err) and "5119" in str(err)


def test_torch_tensors_refused_too() -> None:
    obj = patched("entropy", 2, math.nan)
    arrays = {k: torch.tensor(v) for k, v in obj.items() if isinstance(v, list)}
    expect(lambda: Batch.from_arrays(**arrays), "entropy", 2, "nan")


def _st(obj: dict[str, Any] = BASE, **over: np.ndarray) -> bytes:
    arrays = _np(obj, "") | over
    return save(arrays, metadata={k: str(v) for k, v in obj.items() if not isinstance(v, list)})


def test_safetensors_structural_errors() -> None:
    good = _st()
    assert Batch.from_safetensors(good).num_tokens == 5
    for bad in (good[: len(good) // 2], good[:-3], good[:8], good[:5], b"", b"hello world"):
        with pytest.raises(BatchError) as info:
            Batch.from_safetensors(bad)
        assert str(info.value)
    # A header length pointing far past the end of the data.
    with pytest.raises(BatchError):
        Batch.from_safetensors(struct.pack("<Q", 10**12) + good[8:])
    # Valid header framing but not JSON inside.
    with pytest.raises(BatchError):
        Batch.from_safetensors(struct.pack("<Q", 4) + b"{{{{")
    # JSON header whose entries are malformed (found by the fuzz test below).
    for info in (
        {"data_offsets": [0]},
        {"data_offsets": "ab"},
        {"data_offsets": [0, 8], "shape": "x"},
        {"shape": [1]},
        [1, 2],
    ):
        entry = info if isinstance(info, list) else {"dtype": "F64", "shape": [1]} | info
        header = json.dumps({"logp_rollout": entry}).encode()
        with pytest.raises(BatchError):
            Batch.from_safetensors(struct.pack("<Q", len(header)) + header + bytes(8))


def test_safetensors_field_errors() -> None:
    arrays = _np(BASE, "")
    expect(lambda: Batch.from_safetensors(_st(logp_foo=np.zeros(5))), "logp_foo")
    del arrays["entropy"]
    expect(lambda: Batch.from_safetensors(save(arrays)), "entropy")
    expect(lambda: Batch.from_safetensors(_st(logp_rollout=np.zeros((5, 1)))), "logp_rollout")
    expect(lambda: Batch.from_safetensors(_st(cu_seqlens=np.array([0.0, 2.5, 5.0]))), "cu_seqlens")
    expect(lambda: Batch.from_safetensors(_st(with_(step="abc"))), "step")
    expect(lambda: Batch.from_safetensors(_st(with_(step=2.5))), "step")
    expect(lambda: Batch.from_safetensors(_st(with_(entropy_source="magic"))), "entropy_source")
    expect(lambda: Batch.from_safetensors(_st(with_(policy_version="v7"))), "policy_version")


# ---- nothing crashes: random corruption gives a Batch or a BatchError --------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=6),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.sampled_from([*BASE, "bogus"]),
    index=st.integers(0, 6),
    value=json_values,
    whole=st.booleans(),
)
def test_json_fuzz_never_crashes(key: str, index: int, value: Any, whole: bool) -> None:
    obj = copy.deepcopy(BASE)
    if whole or not isinstance(obj.get(key), list):
        obj[key] = value
    else:
        lst = obj[key]
        lst[index % len(lst)] = value
    try:
        b = Batch.from_json(obj)
    except BatchError as err:
        assert err.field and str(err)
    else:
        assert b.num_tokens == len(b.logp_rollout) > 0


@settings(max_examples=150, deadline=None)
@given(cut=st.integers(0, 2000), pos=st.integers(0, 2000), byte=st.integers(0, 255))
def test_safetensors_fuzz_never_crashes(cut: int, pos: int, byte: int) -> None:
    data = bytearray(_st())
    data[pos % len(data)] = byte
    data = data[: max(0, len(data) - cut % 64)]
    try:
        Batch.from_safetensors(bytes(data))
    except BatchError as err:
        assert str(err)


# ---- nonfinite="drop" ----------------------------------------------------------------------


def test_nonfinite_drop_drops_and_counts() -> None:
    obj = copy.deepcopy(BASE)
    obj["logp_rollout"][1] = math.nan
    obj["entropy"][3] = math.inf
    obj["logp_old"][3] = -math.inf  # same position: counted once
    obj["logp_teacher"][4] = math.nan
    b = Batch.from_json(obj, nonfinite="drop")
    assert b.nonfinite_tokens == 3
    assert list(np.asarray(b.loss_mask)) == [0, 0, 1, 0, 0]
    assert b.num_tokens == 5  # positions stay; they just stop counting
    # Refuse mode is the default and refuses the same batch.
    expect(lambda: Batch.from_json(obj), "logp_rollout", 1, "nan")
    # Drop mode does not forgive other faults.
    obj["logp_train"][2] = 0.5
    expect(lambda: Batch.from_json(obj, nonfinite="drop"), "logp_train", 2)


def test_nonfinite_drop_arrays_and_safetensors() -> None:
    arrays = _np(BASE, "")
    arrays["logp_train"][2] = np.nan
    b = Batch.from_arrays(**arrays, nonfinite="drop")
    assert b.nonfinite_tokens == 1 and int(np.asarray(b.loss_mask)[2]) == 0
    b = Batch.from_safetensors(save(arrays), nonfinite="drop")
    assert b.nonfinite_tokens == 1 and int(np.asarray(b.loss_mask)[2]) == 0


# ---- round trips ----------------------------------------------------------------------------


def _same_batch(a: Batch, b: Batch) -> None:
    aa, bb = a.arrays(), b.arrays()
    assert sorted(aa) == sorted(bb)
    for k in aa:
        np.testing.assert_array_equal(np.asarray(aa[k]), np.asarray(bb[k]), err_msg=k)
    assert a.metadata() == b.metadata()


def test_roundtrip_json_safetensors_arrays() -> None:
    for raw in random_batches(11, 6, long_prob=0.0):
        from_arrays = Batch.from_arrays(**raw.from_arrays_kwargs())
        from_json = Batch.from_json(raw.json_roundtrip())
        from_st = Batch.from_safetensors(raw.to_safetensors_bytes())
        _same_batch(from_arrays, from_json)
        _same_batch(from_arrays, from_st)
        # and back out through the Batch's own encoders
        _same_batch(from_arrays, Batch.from_json(json.loads(json.dumps(from_st.to_json()))))
        _same_batch(from_arrays, Batch.from_safetensors(from_json.to_safetensors()))
        np.testing.assert_array_equal(np.asarray(from_arrays.logp_train), raw.arrays["logp_train"])


def test_roundtrip_rows_identical() -> None:
    for raw in random_batches(12, 4, optional="all"):
        rows = [
            derive_row(accumulate(b)).to_dict()
            for b in (
                Batch.from_arrays(**raw.from_arrays_kwargs()),
                Batch.from_json(raw.json_roundtrip()),
                Batch.from_safetensors(raw.to_safetensors_bytes()),
            )
        ]
        assert rows[0] == rows[1] == rows[2]
