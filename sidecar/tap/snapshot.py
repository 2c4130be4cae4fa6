"""What `Tap.report()` does on the training thread: one copy per array, nothing else.

Invariants:
- `snapshot` makes at most one copy of a value (one memcpy for a contiguous array, into a spare
  `BufferPool` buffer when one fits) and never validates, converts dtypes or hashes; after it
  returns the caller may mutate or free its value.
- A CPU torch tensor is copied through numpy (``np.array`` of its ``.numpy()`` view, bf16 as its
  raw 16-bit words): torch's own ``clone`` runs on its intra-op thread pool, which on a busy host
  costs tens of milliseconds instead of one memcpy.
- A CUDA tensor is copied with ``non_blocking=True`` into pinned host memory; the caller records
  one CUDA event after all copies and the shipper waits on it.
- `to_numpy` (shipper thread) turns every snapshot into a numpy array with the value the
  trainer's dtype holds: bf16 words and fp16 become float32 exactly, as ``tensor.float()`` does.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .pool import BufferPool

__all__ = ["Bf16Words", "detect_rank", "nbytes_of", "snapshot", "snapshot_bytes", "to_numpy"]


@dataclass(frozen=True)
class Bf16Words:
    """The raw 16-bit words of a bfloat16 array (numpy has no bfloat16)."""

    words: np.ndarray  # uint16

    @property
    def nbytes(self) -> int:
        return int(self.words.nbytes)


def _is_torch(value: Any) -> bool:
    return hasattr(value, "detach") and hasattr(value, "is_cuda")  # without importing torch


def nbytes_of(value: Any) -> int | None:
    """The bytes a snapshot of `value` will take, when that is known without copying it."""
    if _is_torch(value):
        return int(value.numel()) * int(value.element_size())
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    return None


def snapshot(value: Any, pool: BufferPool) -> tuple[Any, Any, np.ndarray | None]:
    """A copy of `value` the trainer cannot change any more: (copy, cuda_device_or_None,
    the `pool` buffer the copy lives in or None)."""
    if not _is_torch(value):
        if isinstance(value, np.ndarray):
            return _pooled(value, pool)
        return np.array(value, copy=True), None, None
    tensor = value.detach()
    if tensor.is_cuda:
        import torch

        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host, tensor.device, None
    try:
        if str(tensor.dtype) == "torch.bfloat16":
            import torch

            words, buf = pool.copy(tensor.view(torch.int16).numpy().view(np.uint16))
            return Bf16Words(words), None, buf
        return _pooled(tensor.numpy(), pool)
    except (TypeError, RuntimeError):  # a dtype or layout numpy cannot view: torch copies it
        return tensor.clone(), None, None


def _pooled(arr: np.ndarray, pool: BufferPool) -> tuple[np.ndarray, None, np.ndarray | None]:
    copy, buf = pool.copy(arr)
    return copy, None, buf


def snapshot_bytes(value: Any) -> int:
    """The host bytes one `snapshot` result holds."""
    if isinstance(value, (np.ndarray, Bf16Words)):
        return int(value.nbytes)
    return int(value.numel()) * int(value.element_size())


def _bf16_to_f32(words: np.ndarray) -> np.ndarray:
    out: np.ndarray = (words.astype(np.uint32) << 16).view(np.float32)
    return out


def to_numpy(value: Any) -> np.ndarray:
    """A snapshot as a numpy array; half-precision floats widened to float32 (shipper side)."""
    if isinstance(value, Bf16Words):
        return _bf16_to_f32(value.words)
    if _is_torch(value):  # a pinned host copy of a CUDA tensor, or a clone numpy could not view
        import torch

        if value.dtype == torch.bfloat16:
            return _bf16_to_f32(value.view(torch.int16).numpy().view(np.uint16))
        value = value.numpy()
    arr = np.asarray(value)
    if arr.dtype == np.float16:
        return arr.astype(np.float32)
    return arr


def detect_rank() -> int:
    """``RANK``, ``SLURM_PROCID`` or ``OMPI_COMM_WORLD_RANK``, else torch.distributed's, else 0."""
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    torch = sys.modules.get("torch")  # never import torch here: the tap works without it
    if torch is not None:
        dist = getattr(torch, "distributed", None)
        try:
            if dist is not None and dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # noqa: BLE001 - rank detection must not fail the tap
            pass
    return 0
