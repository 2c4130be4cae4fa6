"""The join: trainer reports + captured rollout records → complete batches for the monitor.

Frameworks that drive SGLang through the proxy know, per sample, either SGLang's request id
(``meta_info.id``) or the sampled token ids, and after the trainer's forward pass they have π and
usually H. They POST that per sample to the proxy (``POST /timwatch/v1/trainer_reports``)::

    {"run": "grpo", "step": 12, "policy_version": 12,          # run defaults to the proxy's
     "samples": [{"rid": "a1b2", "token_ids": [...], "logp_train": [...],
                  "entropy": [...], "loss_mask": [...]}, ...]}  # entropy, loss_mask optional

Each sample is joined with its record (`CaptureStore.pop_by_rid`, or `pop_by_tokens` when only
``token_ids`` are given): μ (``logp_rollout``), the sampled ids (``token_ids``) and per-token
``versions`` come from the record; ``logp_train``, the trainer's ids (``token_ids_train``) and H
from the report. Any position where the two id sequences differ is token-in/token-out drift
(``token_id_mismatch_ratio``, docs/reference/metrics.md); when the lengths differ the common prefix
is joined and the sample counted in ``length_mismatch``. Without trainer entropy the record's top-k
lower bound is used (``entropy_source = "topk"``, needs ``--topk``).

A report whose records are not all captured yet waits up to ``report_ttl_s`` (re-tried on every
new report and by a background sweep); then what joined is forwarded and the rest is counted as
``unjoined_samples``. Records nobody claims expire in the capture store (its ``expired``
counter). Complete batches go to the monitor through `Tap` (bounded queue, retries,
idempotent batch ids), one tap per run.

With ``peers`` (N proxies behind one router, `proxy.join.peers`) what this proxy lacks is taken from
the peers, outside the lock; the report is still forwarded as one batch by this proxy alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ....monitor.core.errors import JoinError
from ..capture import CaptureStore
from ..records import RolloutRecord

__all__ = ["JoinError", "Joiner", "JoinedSample", "parse_report"]

log = logging.getLogger(__name__)

_OPTIONAL_FLOATS = ("entropy", "logp_old", "logp_teacher")


@dataclass
class _Sample:
    rid: str | None
    token_ids: list[int] | None
    logp_train: np.ndarray
    entropy: np.ndarray | None
    loss_mask: np.ndarray | None
    logp_old: np.ndarray | None
    logp_teacher: np.ndarray | None


@dataclass
class JoinedSample:
    record: RolloutRecord
    sample: _Sample
    length: int  # joined positions (the common prefix of record and trainer)


@dataclass
class _Pending:
    run: str
    step: int
    policy_version: int | None
    batch_id: str | None
    deadline: float
    waiting: list[tuple[int, _Sample]]  # (position in report, sample) not joined yet
    joined: dict[int, JoinedSample] = field(default_factory=dict)


# keys -> ({index of a key: its record}, records taken that no key wants any more)
PeerTake = Callable[[list[str | list[int]]], tuple[dict[int, RolloutRecord], list[RolloutRecord]]]


def _float_list(where: str, value: Any) -> np.ndarray:
    if not isinstance(value, list):
        raise JoinError(where, f"{where} must be a list of numbers")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        bad = next(i for i, v in enumerate(value) if not isinstance(v, (int, float)))
        raise JoinError(where, f"{where}[{bad}] must be a number, got {value[bad]!r:.40}") from None
    if arr.ndim != 1:
        raise JoinError(where, f"{where} must be a flat list of numbers")
    return arr


def _int_list(where: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise JoinError(where, f"{where} must be a list of integers")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise JoinError(where, f"{where}[{i}] must be a non-negative integer, got {v!r:.40}")
    return list(value)


def _parse_sample(i: int, obj: Any) -> _Sample:
    where = f"samples[{i}]"
    if not isinstance(obj, Mapping):
        raise JoinError(where, f"{where} must be an object")
    rid = obj.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise JoinError(f"{where}.rid", f"{where}.rid must be a non-empty string")
    ids = obj.get("token_ids", obj.get("output_ids"))
    token_ids = None if ids is None else _int_list(f"{where}.token_ids", ids)
    if rid is None and token_ids is None:
        raise JoinError(where, f"{where} needs a rid or token_ids to find its rollout record")
    if "logp_train" not in obj:
        raise JoinError(f"{where}.logp_train", f"{where}.logp_train is missing")
    logp = _float_list(f"{where}.logp_train", obj["logp_train"])
    n = len(logp)
    if token_ids is not None and len(token_ids) != n:
        raise JoinError(
            f"{where}.token_ids",
            f"{where}.token_ids has {len(token_ids)} entries, logp_train has {n}",
        )
    extra: dict[str, np.ndarray | None] = {}
    for name in (*_OPTIONAL_FLOATS, "loss_mask"):
        value = obj.get(name)
        arr = None if value is None else _float_list(f"{where}.{name}", value)
        if arr is not None and len(arr) != n:
            raise JoinError(
                f"{where}.{name}", f"{where}.{name} has {len(arr)} entries, logp_train has {n}"
            )
        extra[name] = arr
    return _Sample(rid=rid, token_ids=token_ids, logp_train=logp, **extra)


def parse_report(
    obj: Any, default_run: str
) -> tuple[str, int, int | None, str | None, list[_Sample]]:
    """Validate a report body; returns (run, step, policy_version, batch_id, samples)."""
    if not isinstance(obj, Mapping):
        raise JoinError("body", "the body of a trainer report must be a JSON object")
    run = obj.get("run", default_run)
    if not isinstance(run, str) or not run:
        raise JoinError("run", "run must be a non-empty string")
    values: dict[str, int | None] = {}
    for key in ("step", "policy_version"):
        v = obj.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise JoinError(key, f"{key} must be a non-negative integer, got {v!r:.40}")
        values[key] = v
    if values["step"] is None:
        raise JoinError("step", "step is missing")
    batch_id = obj.get("batch_id")
    if batch_id is not None and (not isinstance(batch_id, str) or not 0 < len(batch_id) <= 200):
        raise JoinError("batch_id", "batch_id must be a non-empty string of ≤ 200 chars")
    samples = obj.get("samples")
    if not isinstance(samples, list) or not samples:
        raise JoinError("samples", "samples must be a non-empty list")
    parsed = [_parse_sample(i, s) for i, s in enumerate(samples)]
    return run, int(values["step"] or 0), values["policy_version"], batch_id, parsed


def build_arrays(joined: list[JoinedSample]) -> tuple[dict[str, np.ndarray], str]:
    """Pack joined samples into the packed layout (docs/reference/batch.md); returns (arrays,
    entropy_source)."""
    parts = [j for j in joined if j.length > 0]
    lengths = np.array([j.length for j in parts], dtype=np.int64)
    cu = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])

    def cat(values: list[Any], dtype: Any) -> np.ndarray:
        """One value per part, each cut to its part's length, end to end."""
        return np.concatenate(
            [np.asarray(v, dtype=dtype)[: j.length] for v, j in zip(values, parts, strict=True)]
        )

    def each(get: Callable[[JoinedSample], Any]) -> list[Any] | None:
        """Every part's value, or None when a part has none."""
        values = [get(j) for j in parts]
        return None if any(v is None for v in values) else values

    out: dict[str, np.ndarray] = {
        "cu_seqlens": cu,
        "logp_rollout": cat([j.record.logp for j in parts], np.float64),
        "logp_train": cat([j.sample.logp_train for j in parts], np.float64),
        "token_ids": cat([j.record.output_ids for j in parts], np.int64),
        "loss_mask": cat(
            [np.ones(j.length) if j.sample.loss_mask is None else j.sample.loss_mask
             for j in parts],
            np.uint8,
        ),
    }  # fmt: skip
    if (entropy := each(lambda j: j.sample.entropy)) is not None:
        out["entropy"], source = cat(entropy, np.float64), "trainer"
    elif (entropy := each(lambda j: j.record.entropy_lower)) is not None:
        out["entropy"], source = cat(entropy, np.float64), "topk"
    else:
        raise JoinError(
            "entropy",
            "no entropy: send per-sample entropy from the trainer, or run the proxy with "
            "--topk K so the record carries a top-k entropy bound",
        )
    optional = {
        "token_ids_train": (lambda j: j.sample.token_ids, np.int64),
        "versions": (lambda j: j.record.versions_as_int(), np.int64),
        "logp_old": (lambda j: j.sample.logp_old, np.float64),
        "logp_teacher": (lambda j: j.sample.logp_teacher, np.float64),
    }
    for name, (get, dtype) in optional.items():
        if (values := each(get)) is not None:
            out[name] = cat(values, dtype)
    return out, source


class Joiner:
    """Joins reports with a `CaptureStore` and hands complete batches to ``forward``.

    ``forward(run, step, arrays, policy_version, batch_id, entropy_source)`` is normally
    `TapForwarder`; tests may pass any callable. Thread-safe.
    """

    def __init__(
        self,
        capture: CaptureStore,
        forward: Callable[..., Any],
        *,
        default_run: str = "default",
        rollout_entropy: bool = False,
        report_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        peers: PeerTake | None = None,
    ) -> None:
        self.capture = capture
        self.peers = peers
        self.forward = forward
        self.default_run = default_run
        self.rollout_entropy = rollout_entropy
        self.report_ttl_s = report_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._inflight: set[tuple[str, str]] = set()  # batch ids being joined with peers
        self._seen: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        self.counters = {
            "reports": 0,
            "replayed_reports": 0,
            "joined_samples": 0,
            "pending_reports": 0,
            "expired_reports": 0,
            "unjoined_samples": 0,
            "length_mismatch": 0,
            "empty_samples": 0,
            "forwarded_batches": 0,
            "forward_errors": 0,
            "peer_joined_samples": 0,
        }

    def submit(self, body: Any) -> dict[str, Any]:
        """Join one report now; forward it if complete. Raises `JoinError` on a bad report."""
        run, step, version, batch_id, samples = parse_report(body, self.default_run)
        if not self.rollout_entropy:
            for i, s in enumerate(samples):
                if s.entropy is None:
                    raise JoinError(
                        f"samples[{i}].entropy",
                        f"samples[{i}].entropy is missing and the proxy captures no rollout "
                        "entropy (start it with --topk K for a top-k bound)",
                    )
        with self._lock:
            key = (run, batch_id) if batch_id is not None else None
            if key is not None and (key in self._seen or key in self._inflight):
                self.counters["replayed_reports"] += 1
                return {**self._seen.get(key, {"status": "pending"}), "replayed": True}
            self.counters["reports"] += 1
            pend = _Pending(
                run, step, version, batch_id, self._clock() + self.report_ttl_s,
                list(enumerate(samples)),
            )  # fmt: skip
            self._try_join(pend)
            ask_peers = bool(pend.waiting) and self.peers is not None
            if ask_peers and key is not None:
                self._inflight.add(key)
        if ask_peers:
            try:
                self._join_from_peers([pend])
            finally:
                with self._lock:
                    self._inflight.discard(key)
        with self._lock:
            if pend.waiting:
                self._pending.append(pend)
                answer = {"status": "pending", "joined": len(pend.joined)}
                answer["missing"] = [_key(s) for _, s in pend.waiting]
            else:
                answer = {"status": "forwarded", **self._finish(pend)}
            self._sweep_locked()
            self.counters["pending_reports"] = len(self._pending)
            if key is not None:
                self._seen[key] = answer
                while len(self._seen) > 10_000:
                    self._seen.popitem(last=False)
        return {**answer, "replayed": False}

    def sweep(self) -> None:
        """Retry pending reports (with peers: one request per peer) and expire the old ones."""
        with self._lock:
            self._sweep_locked()
            claimed: list[_Pending] = []
            if self.peers is not None and self._pending:
                claimed, self._pending = self._pending, []
            self.counters["pending_reports"] = len(self._pending) + len(claimed)
        if not claimed:
            return
        try:
            self._join_from_peers(claimed)
        finally:
            with self._lock:
                self._pending.extend(claimed)
                self._sweep_locked()
                self.counters["pending_reports"] = len(self._pending)

    def _join_from_peers(self, pends: list[_Pending]) -> None:
        """Join the waiting samples of ``pends`` (owned by the caller, not in ``_pending``)
        with records taken from the peers. Records taken but no longer wanted go into the
        local store, so nothing a peer handed over is lost."""
        assert self.peers is not None
        wanted = [(pend, pos, s) for pend in pends for pos, s in pend.waiting]
        try:
            found, surplus = self.peers([_key(s) for _, _, s in wanted])
        except Exception:  # noqa: BLE001 - a failing peer must not fail the report
            return log.exception("taking records from the peers failed")
        with self._lock:
            for i, record in found.items():
                pend, pos, sample = wanted[i]
                self._attach(pend, pos, sample, record)
            self.counters["peer_joined_samples"] += len(found)
        for pend in pends:
            pend.waiting = [(pos, s) for pos, s in pend.waiting if pos not in pend.joined]
        for record in surplus:
            self.capture.add(record)

    def _sweep_locked(self) -> None:
        now = self._clock()
        keep: list[_Pending] = []
        for pend in self._pending:
            self._try_join(pend)
            expired = bool(pend.waiting) and now >= pend.deadline
            if expired:
                self.counters["expired_reports"] += 1
                self.counters["unjoined_samples"] += len(pend.waiting)
            if not pend.waiting or expired:
                try:
                    self._finish(pend)
                except JoinError:
                    self.counters["forward_errors"] += 1
            else:
                keep.append(pend)
        self._pending = keep

    def _try_join(self, pend: _Pending) -> None:
        left: list[tuple[int, _Sample]] = []
        for pos, sample in pend.waiting:
            if sample.rid is not None:
                record = self.capture.pop_by_rid(sample.rid)
            else:
                assert sample.token_ids is not None
                record = self.capture.pop_by_tokens(sample.token_ids)
            if record is None:
                left.append((pos, sample))
            else:
                self._attach(pend, pos, sample, record)
        pend.waiting = left

    def _attach(self, pend: _Pending, pos: int, sample: _Sample, record: RolloutRecord) -> None:
        length = min(record.num_tokens, len(sample.logp_train))
        if record.num_tokens != len(sample.logp_train):
            self.counters["length_mismatch"] += 1
        if length == 0:
            self.counters["empty_samples"] += 1
        pend.joined[pos] = JoinedSample(record, sample, length)
        self.counters["joined_samples"] += 1

    def _finish(self, pend: _Pending) -> dict[str, Any]:
        joined = [pend.joined[k] for k in sorted(pend.joined)]
        if not any(j.length for j in joined):
            return {"joined": len(joined), "tokens": 0}
        arrays, source = build_arrays(joined)
        self.forward(pend.run, pend.step, arrays, pend.policy_version, pend.batch_id, source)
        self.counters["forwarded_batches"] += 1
        return {
            "joined": len(joined),
            "tokens": int(arrays["cu_seqlens"][-1]),
            "entropy_source": source,
        }


def _key(sample: _Sample) -> str | list[int]:
    return sample.rid if sample.rid is not None else list(sample.token_ids or [])
