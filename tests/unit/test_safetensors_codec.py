"""Every safetensors dtype for every field kind: accepted with the right values, or refused by
tensor name and dtype — never another exception."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from timwatch.monitor.core.batch import Batch, BatchError
from timwatch.monitor.core.safetensors_codec import DTYPES

BASE: dict[str, list[Any]] = {
    "cu_seqlens": [0, 2, 4],
    "logp_rollout": [-0.5, -1.0, -0.25, -2.0],
    "logp_train": [-0.5, -1.0, -0.25, -2.0],
    "entropy": [0.5, 1.0, 0.25, 2.0],
    "loss_mask": [1, 0, 1, 1],
    "token_ids": [1, 2, 3, 4],
    "versions": [3, 3, 2, 3],
}
REFUSED = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "C64", "I128", "X")
#: what each field may carry; "value" picks values it can hold (0/1 for masks)
KINDS = ("logp_rollout", "entropy", "cu_seqlens", "loss_mask", "token_ids", "versions")


def _encode(dtype: str, values: list[Any]) -> bytes:
    if dtype == "BF16":
        f32 = np.asarray(values, dtype="<f4").view("<u4")
        return (f32 >> 16).astype("<u2").tobytes()
    if dtype == "BOOL":
        return np.asarray(values, dtype=bool).astype("u1").tobytes()
    if dtype in DTYPES:
        with np.errstate(invalid="ignore", over="ignore"):
            return np.asarray(values).astype(DTYPES[dtype]).tobytes()
    return bytes(len(values))  # a refused dtype: any bytes, one per value


def _file(field: str, dtype: str, values: list[Any]) -> bytes:
    header: dict[str, Any] = {}
    blob = b""
    for name, vals in BASE.items():
        data = _encode(dtype, values) if name == field else np.asarray(vals, "<f8").tobytes()
        if name != field and name in ("cu_seqlens", "loss_mask", "token_ids", "versions"):
            data = np.asarray(vals, "<i8").tobytes()
        kind = dtype if name == field else ("F64" if name.startswith(("logp", "ent")) else "I64")
        header[name] = {
            "dtype": kind,
            "shape": [len(vals)],
            "data_offsets": [len(blob), len(blob) + len(data)],
        }
        blob += data
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + blob


def _values(field: str, dtype: str) -> list[Any]:
    values = BASE[field]
    if dtype == "BOOL" and field != "loss_mask":
        return [v != 0 for v in values]
    if dtype[0] in "IU" and field in ("logp_rollout", "entropy"):
        if dtype[0] == "U" and field == "logp_rollout":
            return [0, 0, 0, 0]  # an unsigned log-prob can only be 0
        return [int(v) for v in values]  # integers a float field may carry
    return values


@pytest.mark.parametrize("dtype", [*DTYPES, *REFUSED])
@pytest.mark.parametrize("field", KINDS)
def test_every_dtype_for_every_field(field: str, dtype: str) -> None:
    data = _file(field, dtype, _values(field, dtype))
    try:
        batch = Batch.from_safetensors(data)
    except BatchError as err:
        assert err.field == field, str(err)
        if dtype in REFUSED:
            assert dtype in str(err)
        return
    assert dtype in DTYPES
    got = getattr(batch, field)
    want = np.asarray(_values(field, dtype), dtype=np.float64)
    if dtype in ("F16", "BF16") and field != "loss_mask":
        assert got.dtype == np.float32
    assert np.array_equal(got.astype(np.float64), want)


@pytest.mark.parametrize("field", ["cu_seqlens", "token_ids", "versions"])
def test_integer_fields_refuse_floats_and_accept_small_ints(field: str) -> None:
    for dtype in ("F64", "F32", "F16", "BF16"):
        with pytest.raises(BatchError) as info:
            Batch.from_safetensors(_file(field, dtype, BASE[field]))
        assert info.value.field == field
    for dtype in ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"):
        assert Batch.from_safetensors(_file(field, dtype, BASE[field])).num_tokens == 4


def test_bf16_and_f16_upcast_exactly() -> None:
    values = [-0.5, -1.0, -0.25, -2.0]  # exact in both
    for dtype in ("F16", "BF16"):
        batch = Batch.from_safetensors(_file("logp_train", dtype, values))
        assert batch.logp_train.tolist() == values
