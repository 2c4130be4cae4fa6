"""The trainer tap: `Tap(url, run).report(step, ...)` ships batches without stalling training.

The training loop pays for a snapshot of its arrays (`timwatch.sidecar.tap.snapshot`: one copy
per array into a reused buffer; no validation, encoding or hashing) and a deque append under a
lock the shipper thread never holds while it encodes or posts. One daemon thread does the rest:
bf16/fp16 to float32, validation with `core.batch.Batch` (a malformed batch is counted as
``invalid`` and logged once), the content-derived batch id (`timwatch.sidecar.tap.wire`), and a
safetensors POST to ``{url}/v1/runs/{run}/batches``, retried with backoff on connection errors,
timeouts and 5xx (``Retry-After`` honoured) with the same body; 4xx is never retried.

The queue is bounded by ``queue_size`` batches and ``max_queue_bytes`` of copies: the oldest
are dropped when the monitor is slower than the trainer or down, and a batch larger than the
whole budget is dropped at once. Drops are logged (at most one warning per ``drop_log_s``) and
reported: the next batch POST carries ``Timwatch-Tap-Dropped: N``, the batches this tap lost
(dropped, or given up after retries) since the monitor last counted them; N is kept until a 2xx
answer that counted it (a first attempt answered as a replay did not). `close()` flushes, then
POSTs ``/v1/runs/{run}/finish`` unless ``finish=False``; a failed finish is logged, never raised.

The guard (`timwatch.sidecar.tap.guard`): every answer's ``Timwatch-Page`` header says whether
the run is paged; with ``on_page`` set, the next `report` (or `check_page`) on the training
thread runs the action once per page. `report` raises only `RunPaged`, and only with
``on_page="raise"`` (or an action that raises it), after its batch was queued.
"""

from __future__ import annotations

import atexit
import json
import logging
import random
import threading
import time
import weakref
from typing import Any

from ...monitor.core.batch import Batch, BatchError
from ...monitor.core.clock import SYSTEM_CLOCK, Clock
from ...monitor.core.errors import InputError
from ...monitor.core.page import Page
from ...monitor.core.scalars import check_source, map_scalars, to_float
from .guard import Guard, OnPage
from .pool import BufferPool
from .poster import Poster, post_finish
from .queue import DropLog, DropQueue, Item
from .snapshot import detect_rank, nbytes_of, snapshot, snapshot_bytes, to_numpy
from .stats import TapStats
from .wire import Body, batch_id_for, encode

__all__ = ["DROPPED_HEADER", "Tap"]

log = logging.getLogger("timwatch.tap")

SAFETENSORS = "application/x-safetensors"
JSON = "application/json"
_SCALAR_ITEM_BYTES = 256  # queue budget charged per logged scalar
#: header of a batch POST: batches this tap lost since the monitor last accepted a POST of it
DROPPED_HEADER = "Timwatch-Tap-Dropped"
_HEADER_MAX = 2**31
_FINISH_TIMEOUT_S = 5.0


class Tap:
    """Non-blocking reporter of packed batches to a timwatch service (see the module doc).

    ``queue_size`` and ``max_queue_bytes`` bound the batches waiting to ship; ``timeout`` is the
    per-request HTTP timeout; a batch is retried up to ``max_retries`` times with backoff from
    ``backoff_s`` doubling to ``max_backoff_s`` (jittered down to half, raised to a 503's
    ``Retry-After``, never above ``max_backoff_s``), waited on ``clock``. ``rank`` defaults to
    ``RANK`` (or torch.distributed's rank); generated batch ids are
    ``{id_prefix}-s{step}-{digest[:24]}`` with ``id_prefix`` ``tap-r{rank}``. ``finish``:
    `close()` marks the run finished. ``on_page``: the guard's action when the service pages
    the run: ``"raise"`` (`RunPaged` out of the next `report`), a
    `timwatch.sidecar.tap.MarkerFile`, or a callable taking the `Page`; None (default) only
    records it (`page`).
    """

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        queue_size: int = 64,
        max_queue_bytes: int = 256 * 2**20,
        timeout: float = 30.0,
        max_retries: int = 8,
        backoff_s: float = 0.1,
        max_backoff_s: float = 10.0,
        rank: int | None = None,
        id_prefix: str | None = None,
        flush_at_exit_s: float = 10.0,
        finish: bool = True,
        drop_log_s: float = 30.0,
        clock: Clock = SYSTEM_CLOCK,
        on_page: OnPage | None = None,
    ) -> None:
        if not run:
            raise ValueError("run must be a non-empty string")
        self._guard = Guard(run, on_page)
        self._queue = DropQueue(queue_size, max_queue_bytes)
        self._pool = BufferPool(max_queue_bytes // 4)
        self.url = url.rstrip("/")
        self.run = run
        self.rank = detect_rank() if rank is None else int(rank)
        self.id_prefix = id_prefix or f"tap-r{self.rank}"
        self.queue_size = queue_size
        self.max_queue_bytes = max_queue_bytes
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.finish = finish
        self._cond = threading.Condition()
        self._busy = 0  # items taken by the shipper and not finished
        self._closed = False
        self._touched = False  # report() was called: close() may finish the run
        self._stop = threading.Event()
        self._clock = clock
        self._stats = TapStats()
        self._drops = DropLog(drop_log_s)
        self._logged: set[str] = set()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._http = Poster(self.url, self._headers, timeout)
        self._thread = threading.Thread(target=self._ship_loop, name="timwatch-tap", daemon=True)
        self._thread.start()
        self._flush_at_exit_s = flush_at_exit_s
        ref = weakref.ref(self)
        # interpreter exit (a crash included) flushes but never finishes the run: a trainer that
        # died must keep its stall alert
        self._atexit = lambda: (
            (t := ref()) is not None and t.close(t._flush_at_exit_s, finish=False)
        )
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
        """Snapshot the arrays and enqueue them; True if queued. Then, a step boundary, runs the
        guard's action if the run is paged (`check_page`): raises only `RunPaged`, only when
        ``on_page`` asks for it, and never before the batch is queued.

        Costs one copy per array: no validation, encoding or hashing happens here."""
        queued = self._report(
            step, policy_version, batch_id, entropy_source,
            {
                "cu_seqlens": cu_seqlens, "logp_rollout": logp_rollout, "logp_train": logp_train,
                "entropy": entropy, "loss_mask": loss_mask, "token_ids": token_ids,
                "token_ids_train": token_ids_train, "versions": versions, "logp_old": logp_old,
                "logp_teacher": logp_teacher,
            },
        )  # fmt: skip
        self.check_page(step)
        return queued

    @property
    def page(self) -> Page | None:
        """The run's page as the service's last answer said (None: not paged)."""
        return self._guard.page

    def check_page(self, step: int | None = None) -> None:
        """Run ``on_page`` if the run is paged and it has not run for this page yet; `report`
        calls it. Raises `RunPaged` only with ``on_page="raise"``; an action's other errors are
        logged and counted (``page_errors``)."""
        self._guard.check(step)

    def _report(
        self,
        step: int,
        policy_version: int | None,
        batch_id: str | None,
        entropy_source: str,
        given: dict[str, Any],
    ) -> bool:
        try:
            present = {k: v for k, v in given.items() if v is not None}
            self._touched = True
            if self._closed:
                return False
            known = [nbytes_of(v) for v in present.values()]
            if None not in known and sum(known) > self.max_queue_bytes:  # type: ignore[arg-type]
                self._dropped(1, oversized=True)  # too large for the whole queue: not copied
                return False
            arrays: dict[str, Any] = {}
            buffers = []
            device = None
            for name, value in present.items():
                arrays[name], dev, buf = snapshot(value, self._pool)
                device = device or dev
                if buf is not None:
                    buffers.append(buf)
            event = None
            if device is not None:
                import torch

                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
            nbytes = sum(snapshot_bytes(v) for v in arrays.values())
            meta = {"policy_version": policy_version, "entropy_source": entropy_source}
            item = Item(int(step), batch_id, meta, arrays, nbytes, event, buffers)
            return self._enqueue(item)
        except Exception as exc:  # noqa: BLE001 - the tap must never break training
            self._stats.errors += 1
            self._stats.last_error = f"report: {type(exc).__name__}: {exc}"
            self._log_once("report-error", "timwatch tap.report failed: %s", exc)
            return False

    def log(self, step: int, scalars: Any, *, source: str | None = None) -> bool:
        """Enqueue one step's scalars from the trainer's own logs (``{name: number}``: Python
        numbers, numpy scalars, torch 0-d tensors) to ``POST /v1/runs/{run}/scalars``, named
        as `source` logs them (`timwatch.monitor.core.scalars.SOURCES`; None: timwatch's
        canonical names); True if queued. Never raises; a tensor on a device is copied to the
        host with ``non_blocking=True`` and read on the shipper thread, after its event.

        Same queue, drop and retry rules as `report`. Sending a step again (a retry, a resumed
        trainer) overwrites its stored values: nothing is counted twice. Like `report`, it then
        runs the guard's action if the run is paged (`check_page`): a scalars-only trainer is
        guarded too, and only `RunPaged` (with ``on_page="raise"``) leaves it."""
        queued = self._log(step, scalars, source)
        self.check_page(step)
        return queued

    def _log(self, step: int, scalars: Any, source: str | None) -> bool:
        try:
            self._touched = True
            if self._closed:
                return False
            check_source(source)
            values: dict[str, Any] = {}
            moved = False
            for name, value in dict(scalars).items():
                device = getattr(getattr(value, "device", None), "type", "cpu")
                if device != "cpu" and hasattr(value, "detach"):
                    value = value.detach().to("cpu", non_blocking=True)
                    moved = True
                values[name] = value
            event = _cuda_event_if_pending(values) if moved else None
            meta = {"scalars": values, "source": source}
            item = Item(int(step), None, meta, {}, _SCALAR_ITEM_BYTES * (len(values) + 1), event)
            return self._enqueue(item)
        except Exception as exc:  # noqa: BLE001 - the tap must never break training
            self._stats.errors += 1
            self._stats.last_error = f"log: {type(exc).__name__}: {exc}"
            self._log_once("log-error", "timwatch tap.log failed: %s", exc)
            return False

    def _enqueue(self, item: Item) -> bool:
        with self._cond:
            if self._closed:
                return False
            evicted = self._queue.put(item)
            queued = not evicted or evicted[-1] is not item
            if queued:
                self._stats.reported += 1
                self._cond.notify()
        if evicted:  # outside the lock: nothing reads these copies any more
            for old in evicted:
                self._pool.give(old.buffers)
            self._dropped(len(evicted), oversized=not queued)
        return queued

    def _dropped(self, n: int, oversized: bool) -> None:
        """Count `n` dropped batches (one too large to queue if `oversized`) and maybe warn."""
        with self._cond:
            st = self._stats
            st.dropped += n
            st.oversized += int(oversized)
            st.unreported_drops += n
            to_log = self._drops.add(n)
        if to_log:
            self._warn_drops(to_log)

    def _warn_drops(self, n: int) -> None:
        log.warning(
            "timwatch tap: dropped %d batch(es) of run %s (queue bound: %d batches / %d bytes; "
            "the monitor at %s is down or slower than the trainer); %d dropped in all",
            n,
            self.run,
            self.queue_size,
            self.max_queue_bytes,
            self.url,
            self._stats.dropped,
        )

    def stats(self) -> dict[str, Any]:
        """Counters plus ``queue`` (waiting), ``queue_bytes`` (their snapshots' bytes) and
        ``in_flight`` (being shipped)."""
        with self._cond:
            out = dict(self._stats.__dict__)
            out["refused_statuses"] = dict(self._stats.refused_statuses)
            out["queue"] = len(self._queue)
            out["queue_bytes"] = self._queue.nbytes
            out["in_flight"] = self._busy
        out["pages"], out["page_errors"] = self._guard.pages, self._guard.errors
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued batch is shipped (or given up); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._queue) or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.5)
        return True

    def close(self, timeout: float | None = 10.0, *, finish: bool | None = None) -> bool:
        """Flush for up to `timeout` seconds, stop the shipper, then (``finish``, default the
        constructor's, and only if `report` was ever called) POST the run's finish. Later
        reports are ignored. True if everything queued was shipped or given up in time."""
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
        unlogged = self._drops.take()
        if unlogged:
            self._warn_drops(unlogged)
        if (self.finish if finish is None else finish) and self._touched:
            self._finish()
        return done

    def _finish(self) -> None:
        timeout = min(self._timeout, _FINISH_TIMEOUT_S)
        lost = min(self._stats.unreported_drops, _HEADER_MAX)  # the shipper thread has stopped
        headers = {**self._headers, DROPPED_HEADER: str(lost)} if lost else self._headers
        problem = post_finish(self.url, headers, self.run, timeout)
        if problem is None:
            self._stats.unreported_drops -= lost
        self._stats.finished = problem is None
        if problem is not None:
            log.warning("timwatch tap: could not finish run %s: %s", self.run, problem)

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(finish=False if exc_type is not None else None)  # a crash is not a finish

    # ---- shipper thread ---------------------------------------------------------------------

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)

    def _ship_loop(self) -> None:
        while True:
            with self._cond:
                while not len(self._queue) and not self._stop.is_set():
                    self._cond.wait()
                if not len(self._queue):
                    return
                if self._stop.is_set():  # closed and the flush timed out: give the rest up
                    given_up = self._queue.clear()
                    self._stats.failed += len(given_up)
                    self._cond.notify_all()
                    return
                item = self._queue.pop()
                self._busy += 1
            try:
                self._ship(item)
            except Exception as exc:  # noqa: BLE001 - keep shipping whatever happens
                item.buffers.clear()  # a logged traceback may keep the body: not reused
                self._gave_up()
                self._stats.last_error = f"ship: {type(exc).__name__}: {exc}"
                self._log_once("ship-error", "timwatch tap: shipping failed: %s", str(exc))
            finally:
                item.arrays.clear()  # _ship's body and batch are gone by now: reuse the buffers
                self._pool.give(item.buffers)
                del item
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _gave_up(self) -> None:
        with self._cond:
            self._stats.failed += 1
            self._stats.unreported_drops += 1

    def _encode_scalars(self, item: Item) -> bytes | None:
        if item.event is not None:
            item.event.synchronize()
        source = item.meta["source"]
        try:
            mapped = map_scalars(item.meta["scalars"], source)
        except InputError as exc:
            self._stats.invalid += 1
            self._stats.last_error = f"invalid scalars at step {item.step}: {exc}"
            self._log_once(
                "invalid-scalars", "timwatch tap: scalars of step %s not sent: %s", item.step, exc
            )
            return None
        bad = set(mapped.nonfinite)
        finite = {name: to_float(v) for name, v in item.meta["scalars"].items() if name not in bad}
        body: dict[str, Any] = {"step": item.step, "scalars": finite}
        if source is not None:
            body["source"] = source
        if bad:
            body["nonfinite"] = mapped.nonfinite
        return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()

    def _encode(self, item: Item) -> tuple[Body, int, str] | None:
        if item.event is not None:
            item.event.synchronize()
        arrays: dict[str, Any] = {name: to_numpy(v) for name, v in item.arrays.items()}
        try:
            batch = Batch.from_arrays(step=item.step, batch_id=item.batch_id, **item.meta, **arrays)
        except BatchError as exc:
            self._stats.invalid += 1
            self._stats.last_error = f"invalid batch at step {item.step}: {exc}"
            self._log_once(
                "invalid", "timwatch tap: batch of step %s not sent: %s", item.step, str(exc)
            )
            return None
        batch_id = item.batch_id or batch_id_for(self.id_prefix, batch)
        body, length = encode(batch, batch_id)
        return body, length, batch_id

    def _ship(self, item: Item) -> None:
        if "scalars" in item.meta:
            raw = self._encode_scalars(item)
            if raw is None:
                return
            body: Body = [raw]
            batch_id, ctype = f"scalars of step {item.step}", JSON
            target = f"/v1/runs/{self.run}/scalars"
        else:
            encoded = self._encode(item)
            if encoded is None:
                return
            body, _length, batch_id = encoded
            ctype, target = SAFETENSORS, f"/v1/runs/{self.run}/batches"
        attempt = 0
        while True:
            wait: float | None = None
            with self._cond:
                lost = min(self._stats.unreported_drops, _HEADER_MAX)
            headers = {"Content-Type": ctype}
            if lost:
                headers[DROPPED_HEADER] = str(lost)
            try:
                resp = self._http.post(target, body, headers)
            except OSError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            else:
                self._guard.observe(resp.headers)
                if resp.status < 300:
                    counted = attempt > 0 or not resp.replayed
                    with self._cond:
                        self._stats.sent += 1
                        if counted:
                            self._stats.unreported_drops -= lost
                    return
                reason = f"HTTP {resp.status}: {resp.text[:300]}"
                if resp.status < 500:
                    st = self._stats
                    st.refused += 1
                    st.refused_statuses[resp.status] = st.refused_statuses.get(resp.status, 0) + 1
                    st.last_error = reason
                    self._log_once(
                        f"refused-{resp.status}",
                        "timwatch tap: monitor refused %s (%s); not retried",
                        batch_id,
                        reason,
                    )
                    return
                wait = resp.retry_after
            self._stats.last_error = reason
            if attempt >= self.max_retries or self._stop.is_set():
                self._gave_up()
                self._log_once("gave-up", "timwatch tap: gave up on a batch: %s", reason)
                return
            backoff = min(self.max_backoff_s, self.backoff_s * 2**attempt)
            backoff *= 0.5 + random.random() / 2  # jitter: many ranks must not retry in step
            delay = min(self.max_backoff_s, max(backoff, wait or 0.0))
            attempt += 1
            self._stats.retries += 1
            if self._clock.wait(self._stop, delay):
                self._gave_up()
                return


def _cuda_event_if_pending(values: dict[str, Any]) -> Any:
    """A CUDA event after the asynchronous copies of `values`' pinned tensors, or None."""
    pending = [v for v in values.values() if getattr(v, "is_pinned", lambda: False)()]
    if not pending:
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event
