"""The value checks of `timwatch.monitor.core.batch`: metadata, text, integer ranges and the
bounds that keep every derived float finite.

Invariants a batch that passes them holds:

- ``step`` and ``policy_version`` are Python ints in [0, 2^63 − 1] (a BigInteger column).
- Every integer array fits int64 without wrapping; with ``policy_version`` given, every
  ``policy_version − versions[i]`` does too (the version-lag arithmetic).
- Text (``batch_id``, ``entropy_source``, safetensors metadata) has no control character
  (C0, DEL, C1) and no lone surrogate: it is valid UTF-8 for any store and any exporter.
- On every kept token (``loss_mask = 1``) log-probs lie in [`LOGP_MIN`, `LOGP_MAX`] and entropy
  in [0, `ENTROPY_MAX`]. Masked-out tokens may carry any finite value (padding such as
  −1e30 or ``finfo.min``): the kernels replace them with a neutral token before any arithmetic.
  With these bounds the kernels' float64 sums stay finite for any batch of up to 2^31 tokens
  (|δ| ≤ 1e5, so Σδ⁴ ≤ 2^31·1e20; IS ratios use δ clamped to ±20 before exp; perplexity exps
  are clamped at e^600), which is what keeps every exported sample finite.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import BatchError

__all__ = [
    "ENTROPY_MAX",
    "ENTROPY_SOURCES",
    "INT64_MAX",
    "INT64_MIN",
    "LOGP_MAX",
    "LOGP_MIN",
    "check_floats",
    "check_int_range",
    "check_kept_bounds",
    "check_lag",
    "check_metadata",
    "check_text",
    "first",
    "parse_meta_strings",
]

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
LOGP_MAX = 1e-6
#: the lowest log-prob a kept token may carry: far below any real token (vLLM reports −9999
#: for a masked −inf), and low enough that no float64 sum over 2^31 tokens can overflow
LOGP_MIN = -1e5
#: the highest entropy (nats) a kept token may carry: ln of a vocabulary of e^1000 entries
ENTROPY_MAX = 1e3
ENTROPY_SOURCES = ("rollout", "topk", "trainer")
_LOGP_FIELDS = ("logp_rollout", "logp_train", "logp_old", "logp_teacher")
_BAD_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def first(bad: np.ndarray) -> int:
    """The first index where `bad` is true (callers know one is)."""
    return int(np.flatnonzero(bad)[0])


def check_text(field: str, value: str) -> None:
    """Refuse a control character or a lone surrogate in `value`, naming `field`."""
    m = _BAD_TEXT.search(value)
    if m is not None:
        raise BatchError(
            field,
            f"{field} contains the control character or lone surrogate {m.group()!r} at "
            f"position {m.start()}",
        )


def parse_meta_strings(raw: Mapping[str, str]) -> dict[str, Any]:
    """safetensors metadata values are strings; turn the numeric ones back into ints."""
    out: dict[str, Any] = dict(raw)
    for key in ("step", "policy_version"):
        if key in out:
            text = out[key].strip()
            if not re.fullmatch(r"[+-]?[0-9]{1,40}", text):
                raise BatchError(key, f"{key} must be an integer, got {out[key]!r:.60}")
            out[key] = int(text)
    return out


def check_metadata(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata with defaults filled in; a bad value raises naming its key."""
    out: dict[str, Any] = {"step": 0, "batch_id": None, "policy_version": None}
    out["entropy_source"] = "trainer"
    for key in ("step", "policy_version"):
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise BatchError(key, f"{key} must be an integer, got {value!r:.60}")
        if not 0 <= value <= INT64_MAX:
            raise BatchError(key, f"{key} must be in [0, 2^63 − 1], got {value}")
        out[key] = int(value)
    batch_id = meta.get("batch_id")
    if batch_id is not None:
        if not isinstance(batch_id, str) or not batch_id or len(batch_id) > 256:
            raise BatchError("batch_id", "batch_id must be a non-empty string of ≤ 256 chars")
        check_text("batch_id", batch_id)
        out["batch_id"] = batch_id
    source = meta.get("entropy_source")
    if source is not None:
        if source not in ENTROPY_SOURCES:
            raise BatchError(
                "entropy_source",
                f"entropy_source must be one of {ENTROPY_SOURCES}, got {source!r:.60}",
            )
        out["entropy_source"] = source
    return out


def check_int_range(name: str, arr: np.ndarray) -> None:
    """Refuse an integer array value outside int64 (a uint64 ≥ 2^63 would wrap)."""
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.shape[0]:
        bad = arr > np.uint64(INT64_MAX)
        if bad.any():
            i = first(bad)
            raise BatchError(name, f"{name}[{i}] = {int(arr[i])} is outside int64 (≥ 2^63)", i)


def check_lag(versions: np.ndarray, policy_version: int | None) -> None:
    """Refuse a version so far below ``policy_version`` that the lag overflows int64."""
    if policy_version is None or not versions.shape[0]:
        return
    lowest = policy_version - INT64_MAX  # ≤ 0; policy_version − v ≤ 2^63 − 1 ⟺ v ≥ lowest
    bad = versions < lowest
    if bad.any():
        i = first(bad)
        raise BatchError(
            "versions",
            f"versions[{i}] = {int(versions[i])}: policy_version − versions[{i}] overflows int64",
            i,
        )


def check_floats(name: str, arr: np.ndarray) -> None:
    """Finite everywhere; log-probs ≤ `LOGP_MAX`, other floats (entropy) ≥ 0."""
    finite = np.isfinite(arr)
    if not finite.all():
        i = first(~finite)
        what = "NaN" if np.isnan(arr[i]) else ("+inf" if arr[i] > 0 else "-inf")
        raise BatchError(name, f"{name}[{i}] is {what}", i)
    if name in _LOGP_FIELDS:
        if arr.max() > LOGP_MAX:
            i = first(arr > LOGP_MAX)
            raise BatchError(
                name, f"{name}[{i}] = {float(arr[i])!r} is a positive log-prob (must be ≤ 1e-6)", i
            )
    elif arr.min() < 0:
        i = first(arr < 0)
        raise BatchError(name, f"{name}[{i}] = {float(arr[i])!r} is negative (must be ≥ 0)", i)


def check_kept_bounds(name: str, arr: np.ndarray, keep: np.ndarray) -> None:
    """On kept tokens: log-probs ≥ `LOGP_MIN`, entropy ≤ `ENTROPY_MAX` (see the module doc)."""
    if name in _LOGP_FIELDS:
        bad = (arr < LOGP_MIN) & keep
        what = f"below the floor {LOGP_MIN:g}"
    else:
        bad = (arr > ENTROPY_MAX) & keep
        what = f"above the ceiling {ENTROPY_MAX:g}"
    if bad.any():
        i = first(bad)
        raise BatchError(
            name,
            f"{name}[{i}] = {float(arr[i])!r} is {what} on a kept token (loss_mask = 1); "
            "mask the token out or clip the value",
            i,
        )
