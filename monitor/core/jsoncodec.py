"""JSON encode/decode for the service: orjson when installed (several times faster on the
batch hot path), the standard library otherwise. NaN/inf encode as ``null`` either way so
PostgreSQL JSON columns and strict clients accept every row."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["HAVE_ORJSON", "dumps", "dumps_str", "loads"]

try:
    import orjson

    HAVE_ORJSON = True
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None  # type: ignore[assignment]
    HAVE_ORJSON = False

_OPTS = 0
if HAVE_ORJSON:
    _OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _clean(obj: Any) -> Any:
    """Stdlib fallback: map non-finite floats to None and numpy scalars to Python numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "tolist"):
        return _clean(obj.tolist())
    return obj


def dumps(obj: Any) -> bytes:
    if HAVE_ORJSON:
        return orjson.dumps(obj, option=_OPTS)
    return json.dumps(_clean(obj), allow_nan=False, separators=(",", ":")).encode()


def dumps_str(obj: Any) -> str:
    return dumps(obj).decode()


def loads(data: bytes | str) -> Any:
    if HAVE_ORJSON:
        return orjson.loads(data)
    return json.loads(data)
