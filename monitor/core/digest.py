"""The content digest of a batch: what "the same batch" means for replays and batch ids.

Invariants:
- Two `Batch` objects with the same present fields, the same values and the same metadata
  (step, policy_version, entropy_source) have the same digest, whatever their wire format:
  a JSON body (floats parsed as float64) and a safetensors body (float32 or float64) of the
  same numbers agree, because a float array is hashed as float32 whenever that holds its values
  exactly and as float64 otherwise; integers are hashed as int64 and the mask as uint8.
- Any change of a value, of which fields are present, or of that metadata changes the digest
  (up to blake2b-128 collisions). ``batch_id`` is not part of it: the digest is what a
  ``batch_id`` is checked against.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from timwatch.monitor.core.batch import Batch

__all__ = ["DIGEST_CHARS", "batch_digest"]

#: hex characters of a digest (blake2b with a 16-byte digest)
DIGEST_CHARS = 32

_FIELDS = (
    "cu_seqlens",
    "logp_rollout",
    "logp_train",
    "entropy",
    "loss_mask",
    "token_ids",
    "token_ids_train",
    "versions",
    "logp_old",
    "logp_teacher",
)


def _canonical(name: str, arr: np.ndarray) -> np.ndarray:
    kind = arr.dtype.kind
    if name == "loss_mask":
        return np.ascontiguousarray(arr, dtype=np.uint8)
    if kind == "f":
        if arr.dtype == np.float32:
            return np.ascontiguousarray(arr)
        with np.errstate(over="ignore", invalid="ignore"):  # out of float32 range: not exact
            narrow = arr.astype(np.float32)
        if np.array_equal(narrow.astype(arr.dtype), arr):
            return narrow
        return np.ascontiguousarray(arr, dtype=np.float64)
    return np.ascontiguousarray(arr, dtype=np.int64)


def batch_digest(batch: Batch) -> str:
    """The hex blake2b-128 digest of `batch`'s content (see the module docstring)."""
    h = hashlib.blake2b(digest_size=DIGEST_CHARS // 2)
    h.update(
        f"step={batch.step};policy_version={batch.policy_version};"
        f"entropy_source={batch.entropy_source};".encode()
    )
    for name in _FIELDS:
        value = getattr(batch, name)
        if value is None:
            continue
        arr = _canonical(name, np.asarray(value))
        h.update(f"{name}:{arr.dtype.str}:{arr.shape[0]};".encode())
        h.update(arr.data.cast("B"))
    return h.hexdigest()
