"""JSON encode/decode for the service, the store, the client and the CLI, on orjson.

`dumps` accepts numpy arrays and scalars and dict keys that are not strings; NaN and ±inf
encode as ``null``, so PostgreSQL JSON columns and strict clients accept every row. `loads`
is orjson's depth-limited parser (no recursion error on hostile nesting)."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["dumps", "dumps_str", "loads"]

_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=_OPTS)


def dumps_str(obj: Any) -> str:
    return dumps(obj).decode()


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)
