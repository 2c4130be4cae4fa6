"""The trainer tap: `Tap(url, run).report(step, ...)` ships batches without stalling training.

The training loop pays only for a snapshot of its arrays; everything else happens in one daemon
thread. On the calling thread:

* a CUDA tensor is copied with ``non_blocking=True`` into pinned host memory (PyTorch's caching
  host allocator makes the allocation cheap after the first steps) and one CUDA event is recorded
  on the current stream. Kernels the trainer launches later on that stream run after the copy, so
  mutating or freeing the tensor afterwards is safe; the shipper waits on the event, not the
  trainer.
* a CPU tensor or numpy array is copied (``clone`` / ``np.array``): the trainer may reuse its
  buffers in place the moment `report` returns.

The shipper converts bf16/fp16 to float32, validates with `core.batch.Batch` (a malformed
batch is counted as ``invalid`` and logged once, never sent), serialises to safetensors and POSTs
to ``{url}/v1/runs/{run}/batches``. Connection errors, timeouts and 5xx answers are retried with
exponential backoff (``Retry-After`` honoured); 4xx answers are never retried (``refused``). The
queue is bounded: when the monitor is slower than the trainer the oldest batch is dropped and
counted, so memory stays bounded and the newest data wins.

Each batch gets a deterministic id ``tap-r{rank}-s{step}-m{k}`` (k counts reports of that step in
this process), so a retried POST is answered from the server's store instead of counted twice.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import safetensors.numpy  # noqa: F401 - imported now: a shipper importing at exit fails

from timwatch.monitor.core.batch import Batch, BatchError
from timwatch.sidecar.tap.poster import Poster

__all__ = ["Tap", "TapStats"]

log = logging.getLogger("timwatch.tap")

_ARRAY_FIELDS = (
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
SAFETENSORS = "application/x-safetensors"


@dataclass
class TapStats:
    """Counters of one tap; `Tap.stats()` returns them as a dict with the queue depth."""

    reported: int = 0  # report() calls that enqueued a batch
    sent: int = 0  # batches the monitor accepted (2xx)
    dropped: int = 0  # oldest batches dropped because the queue was full
    refused: int = 0  # 4xx answers (never retried)
    invalid: int = 0  # failed local validation, never sent
    failed: int = 0  # gave up after max_retries (or at close)
    retries: int = 0  # retried attempts
    errors: int = 0  # exceptions swallowed inside report()
    last_error: str | None = None
    refused_statuses: dict[int, int] = field(default_factory=dict)


@dataclass
class _Item:
    step: int
    batch_id: str
    meta: dict[str, Any]
    arrays: dict[str, Any]  # numpy arrays or host torch tensors
    event: Any = None  # torch.cuda.Event guarding pinned copies


def _detect_rank() -> int:
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


def _snapshot(value: Any) -> tuple[Any, Any]:
    """A copy of `value` that the trainer cannot change any more; (copy, cuda_event_or_None)."""
    if hasattr(value, "detach") and hasattr(value, "is_cuda"):  # torch, without importing it
        tensor = value.detach()
        if tensor.is_cuda:
            import torch

            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            return host, tensor.device
        return tensor.clone(), None
    return np.array(value, copy=True), None


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            value = value.float()
        return np.asarray(value.numpy())
    return np.asarray(value)


class Tap:
    """Non-blocking reporter of packed batches to a timwatch service (see the module doc).

    ``queue_size`` bounds the batches waiting to ship; ``timeout`` is the per-request HTTP
    timeout; a batch is retried up to ``max_retries`` times with backoff from ``backoff_s``
    doubling to ``max_backoff_s``. ``rank`` defaults to ``RANK`` (or torch.distributed's rank);
    generated batch ids are ``{id_prefix}-s{step}-m{k}`` with ``id_prefix`` ``tap-r{rank}``.
    """

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        queue_size: int = 64,
        timeout: float = 30.0,
        max_retries: int = 8,
        backoff_s: float = 0.1,
        max_backoff_s: float = 10.0,
        rank: int | None = None,
        id_prefix: str | None = None,
        flush_at_exit_s: float = 10.0,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be ≥ 1, got {queue_size}")
        if not run:
            raise ValueError("run must be a non-empty string")
        self.url = url.rstrip("/")
        self.run = run
        self.rank = _detect_rank() if rank is None else int(rank)
        self.id_prefix = id_prefix or f"tap-r{self.rank}"
        self.queue_size = queue_size
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._counts: dict[int, int] = {}
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._busy = 0  # items taken by the shipper and not finished
        self._closed = False
        self._stop = threading.Event()
        self._stats = TapStats()
        self._logged: set[str] = set()
        headers = {"Content-Type": SAFETENSORS}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = Poster(self.url, headers, timeout)
        self._thread = threading.Thread(target=self._ship_loop, name="timwatch-tap", daemon=True)
        self._thread.start()
        self._flush_at_exit_s = flush_at_exit_s
        ref = weakref.ref(self)
        self._atexit = lambda: (t := ref()) is not None and t.close(t._flush_at_exit_s)
        atexit.register(self._atexit)

    # ---- training-thread side ---------------------------------------------------------------

    def report(
        self,
        step: int,
        *,
        cu_seqlens: Any,
        logp_rollout: Any,
        logp_train: Any,
        entropy: Any,
        loss_mask: Any,
        token_ids: Any = None,
        token_ids_train: Any = None,
        versions: Any = None,
        logp_old: Any = None,
        logp_teacher: Any = None,
        policy_version: int | None = None,
        batch_id: str | None = None,
        entropy_source: str = "trainer",
    ) -> bool:
        """Snapshot the arrays and enqueue them; True if queued. Never raises."""
        try:
            given = {
                "cu_seqlens": cu_seqlens,
                "logp_rollout": logp_rollout,
                "logp_train": logp_train,
                "entropy": entropy,
                "loss_mask": loss_mask,
                "token_ids": token_ids,
                "token_ids_train": token_ids_train,
                "versions": versions,
                "logp_old": logp_old,
                "logp_teacher": logp_teacher,
            }
            arrays: dict[str, Any] = {}
            device = None
            for name, value in given.items():
                if value is not None:
                    arrays[name], dev = _snapshot(value)
                    device = device or dev
            event = None
            if device is not None:
                import torch

                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
            step = int(step)
            if batch_id is None:
                k = self._counts.get(step, 0)
                self._counts[step] = k + 1
                if len(self._counts) > 4096:  # steps long past; keep the map bounded
                    del self._counts[next(iter(self._counts))]
                batch_id = f"{self.id_prefix}-s{step}-m{k}"
            meta = {"policy_version": policy_version, "entropy_source": entropy_source}
            item = _Item(step, batch_id, meta, arrays, event)
            with self._cond:
                if self._closed:
                    return False
                if len(self._queue) >= self.queue_size:
                    self._queue.popleft()
                    self._stats.dropped += 1
                self._queue.append(item)
                self._stats.reported += 1
                self._cond.notify()
            return True
        except Exception as exc:  # noqa: BLE001 - the tap must never break training
            self._stats.errors += 1
            self._stats.last_error = f"report: {type(exc).__name__}: {exc}"
            self._log_once("report-error", "timwatch tap.report failed: %s", exc)
            return False

    def stats(self) -> dict[str, Any]:
        """Counters plus ``queue`` (waiting) and ``in_flight`` (being shipped)."""
        with self._cond:
            out = dict(self._stats.__dict__)
            out["refused_statuses"] = dict(self._stats.refused_statuses)
            out["queue"] = len(self._queue)
            out["in_flight"] = self._busy
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued batch is shipped (or given up); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.5)
        return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Flush for up to `timeout` seconds, then stop the shipper; later reports are ignored."""
        with self._cond:
            if self._closed:
                return True
            self._closed = True
        done = self.flush(timeout)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
        self._http.close()
        atexit.unregister(self._atexit)
        return done

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- shipper thread ---------------------------------------------------------------------

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)

    def _ship_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait()
                if not self._queue:
                    return
                if self._stop.is_set():  # closed and the flush timed out: give the rest up
                    self._stats.failed += len(self._queue)
                    self._queue.clear()
                    self._cond.notify_all()
                    return
                item = self._queue.popleft()
                self._busy += 1
            try:
                self._ship(item)
            except Exception as exc:  # noqa: BLE001 - keep shipping whatever happens
                self._stats.failed += 1
                self._stats.last_error = f"ship: {type(exc).__name__}: {exc}"
                self._log_once("ship-error", "timwatch tap: shipping failed: %s", exc)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _encode(self, item: _Item) -> bytes | None:
        if item.event is not None:
            item.event.synchronize()
        arrays: dict[str, Any] = {name: _to_numpy(v) for name, v in item.arrays.items()}
        try:
            batch = Batch.from_arrays(step=item.step, batch_id=item.batch_id, **item.meta, **arrays)
        except BatchError as exc:
            self._stats.invalid += 1
            self._stats.last_error = f"invalid batch at step {item.step}: {exc}"
            self._log_once("invalid", "timwatch tap: batch of step %s not sent: %s", item.step, exc)
            return None
        return batch.to_safetensors()

    def _ship(self, item: _Item) -> None:
        body = self._encode(item)
        if body is None:
            return
        target = f"/v1/runs/{self.run}/batches"
        attempt = 0
        while True:
            wait: float | None = None
            try:
                resp = self._http.post(target, body)
            except OSError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status < 300:
                    self._stats.sent += 1
                    return
                reason = f"HTTP {resp.status}: {resp.text[:300]}"
                if resp.status < 500:
                    st = self._stats
                    st.refused += 1
                    st.refused_statuses[resp.status] = st.refused_statuses.get(resp.status, 0) + 1
                    st.last_error = reason
                    self._log_once(
                        f"refused-{resp.status}",
                        "timwatch tap: monitor refused batch %s (%s); not retried",
                        item.batch_id,
                        reason,
                    )
                    return
                wait = _retry_after(resp.headers.get("retry-after"))
            self._stats.last_error = reason
            if attempt >= self.max_retries or self._stop.is_set():
                self._stats.failed += 1
                self._log_once("gave-up", "timwatch tap: gave up on a batch: %s", reason)
                return
            backoff = min(self.max_backoff_s, self.backoff_s * 2**attempt)
            backoff *= 0.5 + random.random() / 2  # jitter: many ranks must not retry in step
            delay = min(self.max_backoff_s, max(backoff, wait or 0.0))
            attempt += 1
            self._stats.retries += 1
            if self._stop.wait(delay):
                self._stats.failed += 1
                return


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
