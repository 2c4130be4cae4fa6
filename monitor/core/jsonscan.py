"""A JSON batch body read straight into numpy arrays, in bounded memory and without recursion.

A batch is one flat object: metadata scalars and lists of numbers. `scan_batch` walks the
top-level object itself and parses each list in chunks of about `CHUNK` bytes with orjson, each
chunk's numbers landing in one preallocated array: values equal orjson's parse bit for bit
(it is orjson's parse), peak memory is the body plus the arrays plus one chunk, never a Python
object per number. Anything a batch never holds is refused, naming the field (and index):

- nesting (a list or object inside a list, a container as metadata) — no recursion, so a deeply
  nested body is a 422, not a RecursionError;
- strings, booleans or null inside a number list; floats or integers outside int64 in an
  integer field (``token_ids``, ``token_ids_train``, ``versions``, ``cu_seqlens``);
- duplicate keys, unknown keys, a byte-order mark, invalid UTF-8 in strings, trailing data.

``NaN``, ``Infinity`` and ``-Infinity`` literals (which Python's ``json.dumps`` writes) parse to
floats so validation can name them or ``nonfinite="drop"`` can drop them.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import orjson

from .errors import BatchError

__all__ = ["CHUNK", "INT_LIKE", "scan_batch"]

CHUNK = 1 << 20
#: fields whose numbers must be integers (JSON floats refused by index)
INT_LIKE = ("cu_seqlens", "token_ids", "token_ids_train", "versions")
_ARRAY_FIELDS = (
    "cu_seqlens", "logp_rollout", "logp_train", "entropy", "loss_mask",
    "token_ids", "token_ids_train", "versions", "logp_old", "logp_teacher",
)  # fmt: skip
_META_FIELDS = ("step", "batch_id", "policy_version", "entropy_source")
_WS = re.compile(rb"[ \t\n\r]*")
_SCALAR = re.compile(rb"[^,}\] \t\n\r]*")
_NUMERIC = b"0123456789eE+-., \t\n\r"
_LETTERS = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_STRUCTURAL = re.compile(rb"[^0-9eE+\-., \t\n\ra-zA-Z]")
_I64 = (-(2**63), 2**63 - 1)


def _where(data: bytes, pos: int) -> str:
    return f"byte {pos}" if pos < len(data) else "the end"


def _string_end(data: bytes, pos: int) -> int:
    """Index just past the string starting at ``data[pos] == '"'``."""
    j = pos + 1
    while True:
        j = data.find(b'"', j)
        if j < 0:
            raise BatchError("body", f"body is not valid JSON: unterminated string at byte {pos}")
        k = j
        while data[k - 1] == 0x5C:  # count the backslashes before the quote
            k -= 1
        if (j - k) % 2 == 0:
            return j + 1
        j += 1


def _scalar(data: bytes, pos: int, field: str) -> tuple[Any, int]:
    """A metadata value (string, number, literal) at `pos` and the index after it."""
    c = data[pos : pos + 1]
    if c in (b"[", b"{"):
        kind = "a list" if c == b"[" else "an object"
        raise BatchError(field, f"{field} must be a number or a string, got {kind}")
    end = _string_end(data, pos) if c == b'"' else _SCALAR.match(data, pos).end()  # type: ignore[union-attr]
    try:
        return orjson.loads(data[pos:end]), end
    except orjson.JSONDecodeError as exc:
        raise BatchError(field, f"{field} is not a valid JSON value: {exc}") from None


def _element_error(name: str, items: list[Any], offset: int, integer: bool) -> BatchError | None:
    """The error for the first bad element of a parsed chunk (`offset`: its first index)."""
    for k, item in enumerate(items):
        i = offset + k
        if isinstance(item, bool):
            if name == "loss_mask":
                continue
            return BatchError(name, f"{name}[{i}] must be a number, got {item!r}", i)
        if isinstance(item, int):
            if integer and not _I64[0] <= item <= _I64[1]:
                return BatchError(name, f"{name}[{i}] = {item} is outside int64", i)
        elif isinstance(item, float):
            if integer:
                return BatchError(name, f"{name}[{i}] = {item!r} must be an integer", i)
        else:
            return BatchError(name, f"{name}[{i}] must be a number, got {item!r:.40}", i)
    return None


def _chunk_values(name: str, chunk: bytes, offset: int, integer: bool) -> Any:
    """The numbers of one chunk (a list, or an int64 array for an integer field); the first
    bad element raises, named by its index (`offset`: the chunk's first index)."""
    rest = chunk.translate(None, _NUMERIC)
    if rest and rest.translate(None, _LETTERS):  # a string, list or object (never in a batch)
        m = _STRUCTURAL.search(chunk)
        i = offset + chunk.count(b",", 0, m.start() if m else 0)
        raise BatchError(name, f"{name}[{i}] must be a number", i)
    wrapped = b"[" + chunk + b"]"
    try:
        items = json.loads(wrapped) if rest else orjson.loads(wrapped)
    except ValueError:
        try:
            items = json.loads(wrapped)  # e.g. 1e400, which json reads as inf
        except ValueError as exc:
            at = max(0, getattr(exc, "pos", 1) - 1)
            i = offset + chunk.count(b",", 0, at)
            raise BatchError(name, f"{name}[{i}] is not a valid JSON number", i) from None
    if not rest:
        if not integer:
            return items
        values = np.array(items)
        if values.dtype == np.int64 or not items:
            return values
    err = _element_error(name, items, offset, integer)
    if err is not None:
        raise err
    return items


def _array(data: bytes, pos: int, name: str) -> tuple[np.ndarray, int]:
    """The number list opening at ``data[pos] == '['`` and the index after its ``]``."""
    end = data.find(b"]", pos)
    if end < 0:
        raise BatchError(name, f"{name}: unterminated list")
    integer = name in INT_LIKE
    dtype = np.int64 if integer else np.float64
    if not data[pos + 1 : end].strip():
        return np.empty(0, dtype=dtype), end + 1
    out = np.empty(data.count(b",", pos, end) + 1, dtype=dtype)
    a, filled = pos + 1, 0
    while a <= end:
        b = end if end - a <= CHUNK else data.rfind(b",", a, a + CHUNK)
        if b <= a:
            b = data.find(b",", a + 1, end) if a < end else end
            b = end if b < 0 else b
        items = _chunk_values(name, data[a:b], filled, integer)
        if filled + len(items) > out.shape[0] or (b < end and not len(items)):
            raise BatchError(name, f"{name}[{filled}] is not a valid JSON number", filled)
        out[filled : filled + len(items)] = items
        filled += len(items)
        a = b + 1
    if filled != out.shape[0]:
        raise BatchError(name, f"{name}[{filled}] is not a valid JSON number", filled)
    return out, end + 1


def _key(data: bytes, pos: int) -> tuple[str, int]:
    if data[pos : pos + 1] != b'"':
        raise BatchError("body", f"body is not valid JSON: expected a key at {_where(data, pos)}")
    end = _string_end(data, pos)
    try:
        key = orjson.loads(data[pos:end])
    except orjson.JSONDecodeError as exc:
        raise BatchError("body", f"body is not valid JSON: {exc}") from None
    pos = _WS.match(data, end).end()  # type: ignore[union-attr]
    if data[pos : pos + 1] != b":":
        raise BatchError("body", f"body is not valid JSON: expected ':' at {_where(data, pos)}")
    return key, _WS.match(data, pos + 1).end()  # type: ignore[union-attr]


def _value(data: bytes, pos: int, key: str) -> tuple[Any, int]:
    if key in _META_FIELDS:
        return _scalar(data, pos, key)
    if data[pos : pos + 1] == b"[":
        return _array(data, pos, key)
    if data[pos : pos + 1] == b"{":
        raise BatchError(key, f"{key} must be a list, got an object")
    value, end = _scalar(data, pos, key)
    if value is not None:
        raise BatchError(key, f"{key} must be a list, got {type(value).__name__}")
    return None, end


def scan_batch(data: bytes) -> dict[str, Any]:
    """The fields of a JSON batch body: numpy arrays for the lists, Python values for the
    metadata, null values left out. Raises `BatchError` naming the field (``body`` for the
    framing)."""
    if data.startswith(b"\xef\xbb\xbf"):
        raise BatchError("body", "body starts with a UTF-8 byte-order mark; send plain UTF-8")
    pos = _WS.match(data).end()  # type: ignore[union-attr]
    if pos == len(data):
        raise BatchError("body", "body is empty: a batch must be a JSON object")
    if data[pos : pos + 1] != b"{":
        if data[pos : pos + 1] in b'["-0123456789tfn':
            raise BatchError("body", "a batch must be a JSON object")
        raise BatchError("body", f"body is not valid JSON: unexpected byte at {pos}")
    out: dict[str, Any] = {}
    seen: set[str] = set()
    pos = _WS.match(data, pos + 1).end()  # type: ignore[union-attr]
    if data[pos : pos + 1] == b"}":
        pos += 1
    else:
        while True:
            key, pos = _key(data, pos)
            if key not in _ARRAY_FIELDS and key not in _META_FIELDS:
                raise BatchError(key, f"unknown field {key!r:.60}")
            if key in seen:
                raise BatchError(key, f"duplicate key {key!r}")
            seen.add(key)
            value, pos = _value(data, pos, key)
            if value is not None:
                out[key] = value
            pos = _WS.match(data, pos).end()  # type: ignore[union-attr]
            c = data[pos : pos + 1]
            pos = _WS.match(data, pos + 1).end()  # type: ignore[union-attr]
            if c == b"}":
                break
            if c != b",":
                raise BatchError(
                    "body", f"body is not valid JSON: expected ',' or '}}' at {_where(data, pos)}"
                )
    if _WS.match(data, pos).end() != len(data):  # type: ignore[union-attr]
        raise BatchError("body", "body is not valid JSON: data after the batch object")
    return out
