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
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .batch import Batch

__all__ = ["DIGEST_CHARS", "batch_digest"]

#: hex characters of a digest (blake2b with a 16-byte digest)
DIGEST_CHARS = 32
#: bytes of a field hashed as one leaf of the tree (a fixed part of the digest's definition)
CHUNK_BYTES = 4 * 1024 * 1024
_DIGEST_BYTES = DIGEST_CHARS // 2
_POOL: ThreadPoolExecutor | None = None

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


def _chunk_digest(data: memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def _leaf_digests(chunks: list[memoryview]) -> list[bytes]:
    if len(chunks) > 2:
        try:
            return list(_pool().map(_chunk_digest, chunks))
        except RuntimeError:  # interpreter shutdown (an atexit flush): no new threads
            pass
    return [_chunk_digest(c) for c in chunks]


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="tw-digest")
    return _POOL


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)


def batch_digest(batch: Batch) -> str:
    """The hex blake2b-128 digest of `batch`'s content (see the module docstring).

    A tree hash: each field's canonical bytes are hashed in chunks of ``CHUNK_BYTES`` (in
    parallel threads when the batch is large; hashlib releases the GIL), a field's digest covers
    its name, dtype, length and chunk digests, and the batch's covers the metadata and the field
    digests in field order.
    """
    fields: list[tuple[bytes, list[memoryview]]] = []
    for name in _FIELDS:
        value = getattr(batch, name)
        if value is None:
            continue
        arr = _canonical(name, np.asarray(value))
        raw = arr.data.cast("B")
        chunks = [raw[i : i + CHUNK_BYTES] for i in range(0, max(len(raw), 1), CHUNK_BYTES)]
        fields.append((f"{name}:{arr.dtype.str}:{arr.shape[0]};".encode(), chunks))
    every = [c for _, chunks in fields for c in chunks]
    digests = iter(_leaf_digests(every))
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(
        f"step={batch.step};policy_version={batch.policy_version};"
        f"entropy_source={batch.entropy_source};".encode()
    )
    for head, chunks in fields:
        f = hashlib.blake2b(head, digest_size=_DIGEST_BYTES)
        for _ in chunks:
            f.update(next(digests))
        h.update(f.digest())
    return h.hexdigest()
