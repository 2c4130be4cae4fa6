"""What the shipper thread sends: the batch id rule and a safetensors body that is never joined.

Invariants:
- A generated batch id is ``{id_prefix}-s{step}-{digest[:24]}`` with ``id_prefix``
  ``tap-r{rank}`` by default and `batch_digest` (`timwatch.monitor.core.digest`) of the
  validated batch: the tap's own retries carry the same id (the body is encoded once per batch),
  different content on the same run, step and prefix gets a different id (a restarted trainer or
  two processes sharing a rank lose nothing), and identical content reported twice on one step
  gets the same id, which the monitor answers as a replay: an intentional duplicate is counted
  once. The id never depends on how many batches this process reported before.
- `encode` returns the safetensors body as a list of buffers (a small header, then each array's
  own memory): nothing is concatenated or copied, so the shipper never holds the GIL for a long
  copy while the trainer waits in `report()`. ``Batch.from_safetensors`` reads it back exactly.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from ...monitor.core.batch import Batch
from ...monitor.core.digest import batch_digest

__all__ = ["ID_DIGEST_CHARS", "Body", "batch_id_for", "encode"]

#: hex characters of the content digest in a generated batch id
ID_DIGEST_CHARS = 24

_DTYPES = {
    "float32": "F32",
    "float64": "F64",
    "float16": "F16",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
}

Body = list[Any]  # bytes and memoryviews, sent one after the other


def batch_id_for(id_prefix: str, batch: Batch) -> str:
    """The generated id of `batch` (see the module docstring)."""
    return f"{id_prefix}-s{batch.step}-{batch_digest(batch)[:ID_DIGEST_CHARS]}"


def encode(batch: Batch, batch_id: str) -> tuple[Body, int]:
    """`batch` with `batch_id` as safetensors buffers and their total length in bytes."""
    meta = {k: str(v) for k, v in batch.metadata().items() if v is not None}
    meta["batch_id"] = batch_id
    header: dict[str, Any] = {"__metadata__": meta}
    views: list[memoryview] = []
    offset = 0
    for name, value in batch.wire_arrays().items():
        arr = np.ascontiguousarray(value)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        size = int(arr.nbytes)
        header[name] = {
            "dtype": _DTYPES[arr.dtype.name],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        if size:
            views.append(arr.data.cast("B"))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors' writer aligns the data to 8 bytes the same way
    head = struct.pack("<Q", len(raw)) + raw
    return [head, *views], len(head) + offset
