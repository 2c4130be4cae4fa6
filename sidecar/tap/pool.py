"""Spare copy buffers for `Tap.report()`: copying into memory the process already touched costs
one memcpy, while a fresh allocation of the same size also pays a page fault per 4 KiB page,
which on a busy host makes the copy's p99 several times its median.

Invariants:
- A buffer is either free in the pool or owned by exactly one queued or in-flight batch; the
  tap gives a batch's buffers back only once nothing reads them any more (the batch was dropped
  from the queue, or shipping it ended).
- The free buffers never add up to more than ``max_bytes``; what does not fit is freed.
- Arrays under ``MIN_POOLED`` bytes are not pooled (their copy is cheap anyway), and a free buffer
  serves an array only if it is at most twice the array's size (plus a page), so a large buffer
  is not tied up by a small array.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["MIN_POOLED", "BufferPool"]

MIN_POOLED = 256 * 1024


class BufferPool:
    """Free byte buffers, taken by `copy` on the training thread and given back by either side."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.free_bytes = 0
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()  # held for list operations only

    def copy(self, src: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """A copy of `src` (C-contiguous, same dtype and shape) and the buffer it lives in, or
        None when it was not pooled."""
        need = int(src.nbytes)
        if need < MIN_POOLED or self.max_bytes < need or src.dtype.hasobject:
            return np.array(src, copy=True, order="C"), None
        buf = self._take(need)
        if buf is None:
            buf = np.empty(need + need // 8, np.uint8)  # slack: the next batch may be longer
        out = buf[:need].view(src.dtype).reshape(src.shape)
        np.copyto(out, src, casting="no")
        return out, buf

    def give(self, buffers: list[np.ndarray]) -> None:
        """Return buffers nothing reads any more; the ones that do not fit are freed."""
        with self._lock:
            for buf in buffers:
                if self.free_bytes + buf.nbytes <= self.max_bytes:
                    self._free.append(buf)
                    self.free_bytes += buf.nbytes
        buffers.clear()

    def _take(self, need: int) -> np.ndarray | None:
        with self._lock:
            best = -1
            for i, buf in enumerate(self._free):
                size = buf.nbytes
                if need <= size <= 2 * need + 4096 and (best < 0 or size < self._free[best].nbytes):
                    best = i
            if best < 0:
                return None
            buf = self._free.pop(best)
            self.free_bytes -= buf.nbytes
            return buf
