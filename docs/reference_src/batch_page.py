"""Markers of batch.md: the field lists and rules of monitor/core/batch.py, the header of
examples/batch.safetensors, and refusals produced by running the validation on broken batches."""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from timwatch.monitor.core import batch as wire
from timwatch.monitor.core.batch import Batch, BatchError

from .common import code, merge_check, num, table
from .tables import BATCH_FIELDS, BATCH_METADATA

__all__ = ["EXAMPLE", "markers"]

#: the page's example; every refusal below breaks a copy of it in one way
EXAMPLE: dict[str, Any] = {
    "step": 12,
    "batch_id": "run7-step12-rank0",
    "policy_version": 12,
    "entropy_source": "trainer",
    "cu_seqlens": [0, 3, 5],
    "logp_rollout": [-0.11, -2.3, -0.02, -0.7, -1.2],
    "logp_train": [-0.12, -2.1, -0.02, -0.69, -1.25],
    "entropy": [0.4, 1.9, 0.05, 0.8, 1.1],
    "loss_mask": [0, 1, 1, 1, 1],
    "token_ids": [1734, 29871, 13, 450, 1576],
    "token_ids_train": [1734, 29871, 13, 450, 1576],
    "versions": [12, 12, 12, 11, 12],
}

_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
_DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def _kind(name: str) -> str:
    if name == "cu_seqlens":
        return "int, N_seq + 1"
    if name == "loss_mask":
        return "0/1 (int, bool or float), N"
    return ("float" if name in wire.FLOAT_FIELDS else "int") + ", N"


def _rule(name: str) -> str:
    if name == "cu_seqlens":
        return "starts at 0, non-decreasing, ends at N"
    if name == "loss_mask":
        return "every value 0 or 1"
    if name in wire.LOGP_FIELDS:
        return (
            f"finite, ≤ {num(wire.LOGP_MAX)} (a log-prob); ≥ {num(wire.LOGP_MIN)} where "
            "`loss_mask = 1`"
        )
    if name in wire.FLOAT_FIELDS:
        return f"finite, ≥ 0; ≤ {num(wire.ENTROPY_MAX)} where `loss_mask = 1`"
    if name == "versions":
        return "int64; `policy_version − v` fits int64"
    return "≥ 0, int64"


def _fields() -> str:
    names = wire.REQUIRED_FIELDS + wire.OPTIONAL_FIELDS
    merge_check("batch field", names, BATCH_FIELDS, "tables.BATCH_FIELDS")
    rows = [
        [
            code(n),
            "yes" if n in wire.REQUIRED_FIELDS else "no",
            _kind(n),
            _rule(n),
            BATCH_FIELDS[n],
        ]
        for n in names
    ]
    return table(["field", "required", "kind, length", "rule", "meaning"], rows)


def _metadata() -> str:
    merge_check("metadata key", wire.META_FIELDS, BATCH_METADATA, "tables.BATCH_METADATA")
    rows = []
    for key in wire.META_FIELDS:
        f = Batch.__dataclass_fields__[key]
        kind = str(f.type).replace(" | None", ", optional")
        if key == "entropy_source":
            kind = "one of " + ", ".join(code(s) for s in wire.ENTROPY_SOURCES)
        default = "—" if f.default is None else code(json.dumps(f.default))
        rows.append([code(key), kind, default, BATCH_METADATA[key]])
    return table(["key", "type", "default", "meaning"], rows)


def _safetensors_with_dtype(dtype: str) -> bytes:
    """The example as safetensors with `logp_rollout` declared as `dtype` (zeros: a valid logp)."""
    data = Batch.from_json(EXAMPLE).to_safetensors()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = bytearray(data[8 + n :])
    start, end = header["logp_rollout"]["data_offsets"]
    size = len(EXAMPLE["logp_rollout"]) * _DTYPE_BYTES[dtype]
    body[start:end] = bytes(size)
    shift = size - (end - start)
    for info in header.values():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if offsets and offsets[0] >= end:
            info["data_offsets"] = [offsets[0] + shift, offsets[1] + shift]
    header["logp_rollout"].update(dtype=dtype, data_offsets=[start, start + size])
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(body)


def _dtype_verdicts() -> tuple[list[str], dict[str, str]]:
    accepted, refused = [], {}
    for dtype in _FLOAT_DTYPES:
        try:
            Batch.from_safetensors(_safetensors_with_dtype(dtype))
        except BatchError as exc:
            refused[dtype] = str(exc)
        else:
            accepted.append(dtype)
    return accepted, refused


def _safetensors_header(path: Path) -> str:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    rows = [[code(name), info["dtype"], str(info["shape"])] for name, info in header.items()]
    return (
        table(["tensor", "dtype", "shape"], rows)
        + "\n\n`__metadata__`: "
        + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in sorted(meta.items()))
    )


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(obj: dict[str, Any]) -> None:
        obj[key] = value

    return edit


def _put(key: str, index: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(obj: dict[str, Any]) -> None:
        obj[key][index] = value

    return edit


def _empty(obj: dict[str, Any]) -> None:
    for name in wire.REQUIRED_FIELDS[1:] + wire.OPTIONAL_FIELDS:
        if name in obj:
            obj[name] = []
    obj["cu_seqlens"] = [0]


_CASES: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("a required field is missing", lambda o: o.pop("entropy")),
    ("a field the format does not have", _set("logp_ref", [-0.1] * 5)),
    ("no tokens (N = 0)", _empty),
    ("per-token arrays of different lengths", _set("entropy", [0.4, 1.9, 0.05, 0.8])),
    ("a list entry that is not a number", _put("logp_rollout", 1, "x")),
    ("`cu_seqlens` not starting at 0", _set("cu_seqlens", [1, 3, 5])),
    ("`cu_seqlens` decreasing", _set("cu_seqlens", [0, 3, 2, 5])),
    ("`cu_seqlens` not ending at N", _set("cu_seqlens", [0, 3, 4])),
    ("a non-finite float", _put("logp_rollout", 2, float("nan"))),
    ("a positive log-prob", _put("logp_train", 1, 0.5)),
    ("a negative entropy", _put("entropy", 3, -0.1)),
    ("`loss_mask` outside {0, 1}", _put("loss_mask", 2, 2)),
    ("a fraction in an integer field", _put("token_ids", 1, 1.5)),
    ("a negative token id", _put("token_ids_train", 0, -1)),
    ("`step` or `policy_version` not an integer ≥ 0", _set("step", -1)),
    ("`step` or `policy_version` ≥ 2^63", _set("policy_version", 2**63)),
    ("a float in an integer field", _put("versions", 2, 1e30)),
    ("an integer outside int64", _put("token_ids", 0, 2**64)),
    ("a lag `policy_version − versions[i]` outside int64", _put("versions", 4, -(2**63))),
    ("a kept log-prob below the floor", _put("logp_rollout", 1, -1e308)),
    ("a kept entropy above the ceiling", _put("entropy", 2, 1e6)),
    ("an empty or over-long `batch_id`", _set("batch_id", "")),
    ("a control character in `batch_id`", _set("batch_id", "run7\x00")),
    ("an unknown `entropy_source`", _set("entropy_source", "engine")),
]


def _refusals() -> str:
    rows = []
    for rule, edit in _CASES:
        obj = copy.deepcopy(EXAMPLE)
        edit(obj)
        try:
            Batch.from_json(obj)
        except BatchError as exc:
            index = "—" if exc.index is None else str(exc.index)
            rows.append([rule, code(exc.field), index, code(exc)])
        else:
            raise ValueError(f"batch.md refusal case {rule!r} was accepted by Batch.from_json")
    for dtype, message in _dtype_verdicts()[1].items():
        rows.append([f"a safetensors tensor in {dtype}", code("logp_rollout"), "—", code(message)])
    return table(["refused", "field", "index", "message"], rows)


def _dropped() -> str:
    obj = copy.deepcopy(EXAMPLE)
    obj["entropy"][2] = float("nan")
    batch = Batch.from_json(obj, nonfinite="drop")
    return str(batch.nonfinite_tokens)


def _example() -> str:
    Batch.from_json(EXAMPLE)  # the page shows only what validation accepts
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in EXAMPLE.items())
    return "```json\n{\n" + lines + "\n}\n```"


def _example_file(path: Path) -> str:
    batch = Batch.from_json(json.loads(path.read_text()))
    twin = Batch.from_safetensors(path.with_suffix(".safetensors").read_bytes())
    same = twin.metadata() == batch.metadata() and all(
        np.array_equal(a, twin.arrays()[k]) for k, a in batch.arrays().items()
    )
    if not same or twin.arrays().keys() != batch.arrays().keys():
        raise ValueError(f"{path.name} and its .safetensors twin hold different batches")
    masked = int(np.count_nonzero(batch.loss_mask))
    optional = [code(n) for n in wire.OPTIONAL_FIELDS if getattr(batch, n) is not None]
    return (
        f"{batch.num_tokens} tokens in {batch.num_sequences} sequences, {masked} with "
        f"`loss_mask = 1`, and {', '.join(optional)}"
    )


def markers(root: Path) -> dict[str, str]:
    accepted, refused = _dtype_verdicts()
    return {
        "fields": _fields(),
        "metadata": _metadata(),
        "float_dtypes": ", ".join(accepted),
        "refused_dtypes": ", ".join(refused),
        "logp_min": num(wire.LOGP_MIN),
        "entropy_max": num(wire.ENTROPY_MAX),
        "safetensors_header": _safetensors_header(root / "examples" / "batch.safetensors"),
        "refusals": _refusals(),
        "dropped": _dropped(),
        "example": _example(),
        "example_file": _example_file(root / "examples" / "batch.json"),
    }
