"""Reading the safetensors wire format without trusting its header.

`decode` checks the framing before touching a byte of tensor data: an 8-byte little-endian
header length no larger than the rest, a JSON object header (depth-limited parse), one entry per
tensor with a known dtype, a one-dimensional non-negative shape and ``data_offsets`` that lie in
the data, do not overlap, cover it exactly and hold ``shape × itemsize`` bytes. Every refusal is
a `BatchError` naming the tensor (or ``body`` / ``__metadata__``).

Float16 and bfloat16 are upcast to float32 (bfloat16 is the high half of a float32, so the
upcast is a shift); BOOL bytes must be 0 or 1. Any other dtype (F8_*, complex, …) is refused by
name and dtype.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .batch_checks import check_text
from .errors import BatchError
from .jsoncodec import loads

__all__ = ["DTYPES", "decode"]

#: the safetensors dtypes a batch may use, as little-endian numpy dtypes (BF16 read as uint16)
DTYPES: dict[str, str] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "u1",
}  # fmt: skip
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def _header(data: bytes) -> tuple[dict[str, Any], int]:
    if len(data) < 8:
        raise BatchError("body", "invalid safetensors: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8 or n > _MAX_HEADER:
        raise BatchError("body", f"invalid safetensors: header of {n} bytes is truncated")
    try:
        header = loads(data[8 : 8 + n])
    except (ValueError, RecursionError) as exc:
        raise BatchError("body", f"invalid safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise BatchError("body", "invalid safetensors header: not an object")
    return header, 8 + n


def _metadata(info: Any) -> dict[str, str]:
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in info.items()
    ):
        raise BatchError("__metadata__", "safetensors metadata must map names to strings")
    for key, value in info.items():
        check_text("__metadata__", key)
        check_text(key, value)
    return info


def _entry(name: str, info: Any, size: int) -> tuple[str, int, int, int]:
    """(dtype, length, begin, end) of one tensor entry, checked against the data size."""
    check_text("body", name)
    bad = BatchError(name, f"invalid safetensors: tensor {name!r:.60} has a malformed header")
    if not isinstance(info, dict):
        raise bad
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list):
        raise bad
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise bad
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in [*offsets, *shape]):
        raise bad
    if any(v < 0 for v in [*offsets, *shape]):
        raise BatchError(name, f"invalid safetensors: tensor {name!r:.60} has a negative size")
    if dtype not in DTYPES:
        raise BatchError(
            name,
            f"{name} has dtype {dtype!r:.20}; send F64, F32, F16, BF16, an integer dtype or BOOL",
        )
    if len(shape) != 1:
        raise BatchError(name, f"{name} must be one-dimensional, got shape {tuple(shape)}")
    begin, end = offsets
    if not begin <= end <= size:
        raise BatchError(name, f"invalid safetensors: tensor {name!r:.60} is truncated")
    if end - begin != shape[0] * np.dtype(DTYPES[dtype]).itemsize:
        raise BatchError(
            name,
            f"invalid safetensors: tensor {name!r:.60} has {end - begin} bytes for "
            f"{shape[0]} × {dtype}",
        )
    return dtype, shape[0], begin, end


def _array(name: str, data: bytes, at: int, dtype: str, length: int) -> np.ndarray:
    arr = np.frombuffer(data, dtype=DTYPES[dtype], count=length, offset=at)
    if dtype == "F16":
        return arr.astype(np.float32)
    if dtype == "BF16":
        return (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype == "BOOL":
        if length and arr.max() > 1:
            i = int(np.flatnonzero(arr > 1)[0])
            raise BatchError(name, f"{name}[{i}] is BOOL byte {int(arr[i])}, not 0 or 1", i)
        return arr.view(np.bool_)
    if not arr.flags.aligned:
        return arr.copy()
    return arr.astype(arr.dtype.newbyteorder("="), copy=False)


def decode(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors (by name, one-dimensional numpy arrays) and the metadata strings of `data`."""
    header, start = _header(data)
    meta = _metadata(header.pop("__metadata__", None) or {})
    size = len(data) - start
    entries = {name: _entry(name, info, size) for name, info in header.items()}
    spans = sorted((begin, end, name) for name, (_d, _n, begin, end) in entries.items())
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            what = "overlaps another tensor" if begin < pos else "leaves a gap before it"
            raise BatchError(name, f"invalid safetensors: tensor {name!r:.60} {what}")
        pos = end
    if pos != size:
        raise BatchError("body", f"invalid safetensors: {size - pos} bytes after the last tensor")
    arrays = {
        name: _array(name, data, start + begin, dtype, length)
        for name, (dtype, length, begin, _end) in entries.items()
    }
    return arrays, meta
