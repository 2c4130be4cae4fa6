"""One finished rollout sample as the sidecar captured it, plus the top-k entropy bounds.

A `RolloutRecord` is engine-agnostic: the SGLang proxy and the vLLM adapter both produce it,
the capture store holds it, and the join with trainer reports consumes it.

Entropy from top-k (``entropy_source = "topk"`` in docs/reference/batch.md). The engine returns the
log-probs of a set S of tokens that contains the true top-k of the next-token distribution p. Let
``m = 1 - Σ_{i∈S} p_i`` be the mass outside S and ``t`` the k-th largest probability in S. Then

* every token outside S has probability ≤ t (it is not in the top-k), so its term
  ``-q log q ≥ -q log t``; summed: ``H ≥ H_S + m·(-log t)`` where ``H_S = -Σ_{i∈S} p_i log p_i``.
  That is ``entropy_lower``; it is never above the true entropy and is tighter than ``H_S``.
* the tail's entropy is largest when its mass is spread evenly over the ``V - |S|`` remaining
  tokens: ``H_tail ≤ m·log((V - |S|)/m)``. That is ``entropy_tail``; the true entropy lies in
  ``[entropy_lower, entropy_lower - m·(-log t) + entropy_tail]`` and in particular
  ``H ≤ H_S + entropy_tail``. It needs the vocabulary size V; without it the tail is unbounded
  and ``entropy_tail`` is ``None``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import groupby
from typing import Any

import numpy as np

from ...monitor.core.errors import WireError

__all__ = [
    "RolloutRecord",
    "topk_entropy_bounds",
    "version_as_int",
    "version_runs",
    "runs_from_versions",
    "weight_spans",
]


def topk_entropy_bounds(
    rows: np.ndarray | Sequence[Sequence[float | None]], *, vocab_size: int | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(entropy_lower, entropy_tail)`` per position from each position's top-k log-probs.

    ``rows`` is an ``(n, k)`` array or n lists (ragged, ``None`` or ``-inf`` entries for
    probability 0, as an engine serialises ``-inf``); the tail is None without ``vocab_size``.
    A row of length ``|S|`` leaves ``V - |S|`` tokens to the tail."""
    if isinstance(rows, np.ndarray):
        logprobs, width = rows.astype(np.float64, copy=False), np.full(len(rows), rows.shape[1])
    else:
        width = np.array([len(row) for row in rows], dtype=np.int64)
        logprobs = np.full((len(rows), int(width.max(initial=0))), -np.inf)
        for i, row in enumerate(rows):
            logprobs[i, : len(row)] = [-np.inf if lp is None else lp for lp in row]
    p = np.exp(logprobs)
    live = p > 0.0
    head = -(p * np.where(live, logprobs, 0.0)).sum(axis=1)
    mass = np.clip(1.0 - p.sum(axis=1), 0.0, 1.0)
    threshold = np.where(live, p, np.inf).min(axis=1)  # t: the k-th largest probability
    add = (mass > 0.0) & np.isfinite(threshold) & (threshold > 0.0)
    with np.errstate(divide="ignore"):
        gap = -np.log(np.minimum(threshold, 1.0))
    lower = np.where(add, head + mass * np.where(add, gap, 0.0), head)
    if vocab_size is None:
        return lower, None
    rest = vocab_size - width  # tokens outside S: the tail's mass spread evenly over them
    spread = (mass > 0.0) & (rest > 0)
    per = np.maximum(rest, 1) / np.where(spread, mass, 1.0)
    return lower, np.where(spread, np.maximum(mass * np.log(per), 0.0), 0.0)


def weight_spans(spans: Any) -> list[tuple[int, int, str | None]]:
    """SGLang's ``meta_info.weight_versions`` as validated ``(start, end, label)`` spans (end
    exclusive, label None when the span names no version); a malformed list is a `WireError`
    naming the index."""
    if not isinstance(spans, list):
        raise WireError(f"meta_info.weight_versions: expected a list, got {spans!r}")
    out: list[tuple[int, int, str | None]] = []
    for i, span in enumerate(spans):
        if not isinstance(span, dict):
            raise WireError(f"meta_info.weight_versions[{i}]: expected an object, got {span!r}")
        start, end, version = span.get("start"), span.get("end"), span.get("version")
        if not isinstance(start, int) or not isinstance(end, int) or not 0 <= start <= end:
            raise WireError(f"meta_info.weight_versions[{i}]: bad start/end {start!r}/{end!r}")
        out.append((start, end, None if version is None else str(version)))
    return out


def version_runs(spans: Any, n: int, default: str | None) -> tuple[tuple[str | None, int], ...]:
    """SGLang's ``meta_info.weight_versions`` spans over ``n`` output tokens as version runs
    (`RolloutRecord.runs`); a token no span covers has the ``default`` label."""
    if n == 0:
        return ()
    if spans is None:
        return ((default, n),)
    valid = weight_spans(spans)
    if len(valid) == 1 and valid[0][0] == 0 and valid[0][1] >= n:
        return ((valid[0][2], n),)  # one version for the whole answer: the usual case
    labels: list[str | None] = [default]
    which = np.zeros(n, dtype=np.int64)
    for start, end, label in valid:
        labels.append(label)
        which[start:end] = len(labels) - 1
    return runs_from_versions([labels[i] for i in which.tolist()])


def runs_from_versions(versions: Sequence[str | None]) -> tuple[tuple[str | None, int], ...]:
    """Per-token version labels run-length encoded, ``((label, count), ...)``: `RolloutRecord.runs`
    and the peers' take answer hold them so."""
    return tuple((label, sum(1 for _ in same)) for label, same in groupby(versions))


def version_as_int(label: str | None) -> int | None:
    """An engine's weight-version label as an int (``"7"``, ``"step-7"``, ``"v_7"``), else None."""
    if label is None:
        return None
    digits = label.rsplit("-", 1)[-1].rsplit("_", 1)[-1]
    try:
        return int(digits)
    except ValueError:
        return None


# What one record costs beyond its arrays: the object, its arrays' headers, the store's
# index entries (checked with tracemalloc: tests/unit/test_proxy_records.py).
HELD_OVERHEAD_BYTES = 1024


def _owned(arr: np.ndarray) -> np.ndarray:
    """``arr``, copied when it is a view: a view keeps its whole base buffer alive (a reader's
    scratch array, a peer's answer), which `RolloutRecord.nbytes` would not count."""
    return arr if arr.base is None else arr.copy()


def _ids(values: Any) -> np.ndarray:
    """Token ids as int32 when every one fits, else int64; an array of its own."""
    ids = np.ascontiguousarray(values, dtype=np.int64)
    if ids.size and (ids.min() < -(2**31) or ids.max() >= 2**31):
        return _owned(ids)
    return ids.astype(np.int32)


def _floats(values: Any) -> np.ndarray:
    return _owned(np.ascontiguousarray(values, dtype=np.float64))


class RolloutRecord:
    """A finished sample: what the engine sampled, with which log-prob (μ) and weight version.

    Held as arrays, no per-token Python objects (28 bytes per output token with entropy
    bounds, 4 per prompt token): ids as int32 where they fit, log-probs and entropy bounds as
    float64, and the per-token weight-version labels run-length encoded in ``runs``,
    ``((label, count), ...)`` whose counts sum to the number of output tokens. Built from
    per-token ``versions`` (SGLang reports strings, e.g. ``"default"`` or ``"step-12"``) or
    from ``runs``; `versions` gives them back per token. Each array is the record's own (a view
    is copied), so `nbytes` is what the record keeps alive. A record is never changed after it
    is built, so the proxy's event loop and the joiner share it without copying.

    ``finish_reason`` is the engine's type (``stop``, ``length``, ``abort``). ``sampling``
    holds the request's sampling parameters as sent (vLLM proxy: ``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``seed``; None when unknown) and ``logprobs_mode`` the engine's
    log-prob mode (``raw_logprobs`` or ``processed_logprobs``; None when unknown). A
    per-token array of another length than ``output_ids`` is a `ValueError` naming it.
    """

    __slots__ = (
        "rid", "input_ids", "output_ids", "logp", "runs", "finish_reason", "weight_version",
        "entropy_lower", "entropy_tail", "entropy_source", "created", "engine", "sampling",
        "logprobs_mode",
    )  # fmt: skip

    def __init__(
        self,
        rid: str,
        input_ids: Any,
        output_ids: Any,
        logp: Any,
        versions: Sequence[str | None] | None = None,
        finish_reason: str | None = None,
        weight_version: str | None = None,
        entropy_lower: Any = None,
        entropy_tail: Any = None,
        entropy_source: str | None = None,
        created: float | None = None,
        engine: str = "sglang",
        sampling: dict[str, Any] | None = None,
        logprobs_mode: str | None = None,
        *,
        runs: tuple[tuple[str | None, int], ...] | None = None,
    ) -> None:
        self.rid = rid
        self.input_ids = None if input_ids is None else _ids(input_ids)
        self.output_ids = _ids(output_ids)
        self.logp = _floats(logp)
        self.runs = runs_from_versions(versions or ()) if runs is None else runs
        self.finish_reason, self.weight_version = finish_reason, weight_version
        self.entropy_lower = None if entropy_lower is None else _floats(entropy_lower)
        self.entropy_tail = None if entropy_tail is None else _floats(entropy_tail)
        self.entropy_source = entropy_source
        self.created = time.time() if created is None else created
        self.engine, self.sampling, self.logprobs_mode = engine, sampling, logprobs_mode
        n = len(self.output_ids)
        if sum(c for _, c in self.runs) != n:
            raise ValueError(f"RolloutRecord {rid!r}: versions do not cover {n} tokens")
        for name in ("logp", "entropy_lower", "entropy_tail"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(
                    f"RolloutRecord {rid!r}: {name} has {len(value)} entries, output_ids has {n}"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def versions(self) -> tuple[str | None, ...]:
        """The weight-version label of each output token (`runs` expanded)."""
        return tuple(label for label, count in self.runs for _ in range(count))

    def versions_as_int(self) -> list[int] | None:
        """Per-token versions as ints when every label is an integer (``"7"``, ``"step-7"``)."""
        out: list[int] = []
        for label, count in self.runs:
            value = version_as_int(label)
            if value is None:
                return None
            out += [value] * count
        return out

    @property
    def nbytes(self) -> int:
        """Bytes this record holds, its arrays exactly plus `HELD_OVERHEAD_BYTES`."""
        arrays = (self.input_ids, self.output_ids, self.logp, self.entropy_lower, self.entropy_tail)
        size = sum(a.nbytes for a in arrays if a is not None)
        return size + HELD_OVERHEAD_BYTES + len(self.rid) + 64 * len(self.runs)

    def token_key(self) -> bytes:
        """The output ids as int64 bytes: equal keys mean equal token sequences."""
        return self.output_ids.astype(np.int64).tobytes()

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready lists, one entry per token (``versions`` for ``runs``)."""
        out = {k: getattr(self, k) for k in self.__slots__ if k != "runs"}
        for k in ("input_ids", "output_ids", "logp", "entropy_lower", "entropy_tail"):
            out[k] = None if out[k] is None else out[k].tolist()
        return out | {"versions": list(self.versions)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutRecord:
        """Inverse of `to_dict`."""
        keys = [k for k in cls.__slots__ if k != "runs"] + ["versions"]
        return cls(**{k: d[k] for k in keys if k in d} | {"input_ids": d.get("input_ids")})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RolloutRecord) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RolloutRecord(rid={self.rid!r}, {self.num_tokens} tokens, {self.engine})"
