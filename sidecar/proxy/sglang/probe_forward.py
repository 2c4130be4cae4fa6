"""Ship prefill-probe results to the monitor as their own run, ``<run>-prefill-probe``.

In that run SGLang's prefill path plays the trainer: per probed sample, ``logp_rollout`` is the
decode μ the client's request sampled with, ``logp_train`` the prefill log-prob of the same
tokens, ``token_ids`` the output ids, ``entropy`` the prefill top-k lower bound
(``entropy_source = "topk"``) and ``versions`` the decode tokens' weight versions. The batch's
``policy_version`` is the weight version the prefill ran with, so a probe whose weights changed
between decode and prefill (`ProbeResult.same_version` false) still goes in and shows up as
version lag instead of being hidden.

Results are buffered and shipped every ``batch_size`` results or ``flush_s`` seconds, whichever
comes first, one batch per prefill weight version. The batch's step is that version when it is
an integer label (``"12"``, ``"step-12"``: the probe history then lines up with training steps;
batches of one version add up into one row), otherwise a per-process counter. Shipping goes
through `Tap` (bounded queue, retries, idempotent batch ids) from a daemon thread;
`ProbeForwarder.add`, the only call on the proxy's event loop, appends under a lock.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool

from ...tap import Tap
from ..records import version_as_int
from .probe import ProbeResult

__all__ = ["PROBE_RUN_SUFFIX", "ProbeBatch", "ProbeForwarder", "install_probe_forward", "pack"]

log = logging.getLogger(__name__)

PROBE_RUN_SUFFIX = "-prefill-probe"


@dataclass
class ProbeBatch:
    """One packed batch of probe results that share a prefill weight version."""

    policy_version: int | None
    arrays: dict[str, np.ndarray]
    rids: list[str]


def _usable(r: ProbeResult) -> str | None:
    """Why a result cannot go into a batch (None when it can)."""
    n = len(r.output_ids)
    if n == 0:
        return "empty"
    if r.entropy_prefill is None:
        return "no_entropy"
    if len(r.logp_prefill) != n or len(r.logp_decode) != n or len(r.entropy_prefill) != n:
        return "length_mismatch"
    finite = all(math.isfinite(x) for x in (*r.logp_decode, *r.logp_prefill, *r.entropy_prefill))
    return None if finite else "nonfinite"


def pack(results: list[ProbeResult]) -> list[ProbeBatch]:
    """Group results by prefill weight version and pack each group (the packed layout of
    docs/reference/batch.md).

    Callers drop unusable results first (`ProbeForwarder` counts them); ``versions`` is set
    only when every token of the group has an integer version label.
    """
    groups: dict[str | None, list[ProbeResult]] = {}
    for r in results:
        groups.setdefault(r.prefill_weight_version, []).append(r)
    out = []
    for label, group in groups.items():
        lengths = [len(r.output_ids) for r in group]
        cu = np.zeros(len(group) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        n = int(cu[-1])
        arrays: dict[str, np.ndarray] = {
            "cu_seqlens": cu,
            "logp_rollout": np.concatenate([r.logp_decode for r in group], dtype=np.float64),
            "logp_train": np.concatenate([r.logp_prefill for r in group], dtype=np.float64),
            "entropy": np.concatenate([r.entropy_prefill or () for r in group], dtype=np.float64),
            "loss_mask": np.ones(n, dtype=np.uint8),
            "token_ids": np.concatenate([r.output_ids for r in group], dtype=np.int64),
        }
        versions = [version_as_int(v) for r in group for v in r.versions]
        if all(v is not None for v in versions):
            arrays["versions"] = np.asarray(versions, dtype=np.int64)
        out.append(ProbeBatch(version_as_int(label), arrays, [r.rid for r in group]))
    return out


class ProbeForwarder:
    """Buffers `ProbeResult`s and reports them through ``report`` (normally a `Tap`'s).

    ``report(step, **arrays, policy_version=..., entropy_source="topk")`` must not block; the
    flush runs on this object's thread (`start`) or in `close`.
    """

    def __init__(
        self,
        report: Callable[..., Any],
        *,
        batch_size: int = 64,
        flush_s: float = 10.0,
        report_stats: Callable[[], dict[str, Any]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        if not flush_s > 0:
            raise ValueError(f"flush_s must be > 0, got {flush_s}")
        self.report = report
        self.report_stats = report_stats
        self.batch_size = batch_size
        self.flush_s = flush_s
        self._clock = clock
        self._cond = threading.Condition()
        self._buffer: list[ProbeResult] = []
        self._oldest: float | None = None
        self._next_step = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.counters = {
            "results": 0,
            "batches": 0,
            "sequences": 0,
            "tokens": 0,
            "stale_sequences": 0,
            "empty": 0,
            "no_entropy": 0,
            "length_mismatch": 0,
            "nonfinite": 0,
        }

    def add(self, result: ProbeResult) -> None:
        with self._cond:
            self.counters["results"] += 1
            reason = _usable(result)
            if reason is not None:
                self.counters[reason] += 1
                return
            if not self._buffer:
                self._oldest = self._clock()
            self._buffer.append(result)
            if len(self._buffer) >= self.batch_size:
                self._cond.notify()

    def flush(self) -> int:
        """Pack and report everything buffered now; returns the number of batches."""
        with self._cond:
            taken, self._buffer, self._oldest = self._buffer, [], None
        if not taken:
            return 0
        batches = pack(taken)
        for batch in batches:
            if batch.policy_version is not None:
                step = batch.policy_version
            else:
                with self._cond:
                    step, self._next_step = self._next_step, self._next_step + 1
            self.report(
                step,
                **batch.arrays,
                policy_version=batch.policy_version,
                entropy_source="topk",
            )
        with self._cond:
            self.counters["batches"] += len(batches)
            self.counters["sequences"] += len(taken)
            self.counters["tokens"] += sum(len(r.output_ids) for r in taken)
            self.counters["stale_sequences"] += sum(not r.same_version for r in taken)
        return len(batches)

    def _due(self) -> bool:
        if len(self._buffer) >= self.batch_size:
            return True
        return self._oldest is not None and self._clock() - self._oldest >= self.flush_s

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._due():
                    if self._oldest is None:
                        wait = self.flush_s
                    else:
                        wait = self._oldest + self.flush_s - self._clock()
                    self._cond.wait(max(wait, 0.01))
                if self._stop:
                    return
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - keep forwarding later results
                log.exception("prefill-probe flush failed")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="timwatch-probe-fwd", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and flush what is left (the caller closes the tap afterwards)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.flush()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            out: dict[str, Any] = {**self.counters, "buffered": len(self._buffer)}
        if self.report_stats is not None:
            out["tap"] = self.report_stats()
        return out


def install_probe_forward(
    app: Starlette,
    *,
    monitor: str,
    run: str = "default",
    token: str | None = None,
    batch_size: int = 64,
    flush_s: float = 10.0,
) -> ProbeForwarder:
    """Forward an SGLang proxy app's probe results to run ``<run>-prefill-probe``.

    Call before the app starts (the prober is created in its lifespan); a proxy built with
    ``probe_rate = 0`` never probes, so nothing is sent then.
    """
    state = app.state.proxy
    tap = Tap(
        monitor,
        run + PROBE_RUN_SUFFIX,
        token or os.environ.get("TIMWATCH_TOKEN"),
        id_prefix=f"probe-{socket.gethostname()}-{os.getpid()}",
        finish=False,  # one of several proxy replicas stopping does not finish the probe run
    )
    forwarder = ProbeForwarder(
        tap.report, batch_size=batch_size, flush_s=flush_s, report_stats=tap.stats
    )
    state.probe_sink = forwarder
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[Any]:
        forwarder.start()
        try:
            async with inner(a) as value:
                yield value
        finally:
            # The inner lifespan drained the prober: every result is in the buffer now.
            await run_in_threadpool(forwarder.close)
            await run_in_threadpool(tap.close)

    app.router.lifespan_context = lifespan
    return forwarder
