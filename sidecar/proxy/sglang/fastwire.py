"""SGLang ``/generate`` answers read and restored on their bytes, without parsing them whole.

`proxy.sglang.wire` parses every answer into Python objects; a 4,096-token answer is ~4,000
small lists, and a cumulative stream repeats all of them in every chunk. This module works on the
compact JSON SGLang writes instead, and runs only where the C reader is built (`native`):

* Keys and the quote-free values after them (``output_token_logprobs``, the top-k rows,
  ``prompt_token_ids``, ...) are found on the bytes by `proxy.sglang.keyspan`, which refuses
  (`NotFast`) any value with a string in it; the caller then takes the object path, so this
  module never guesses.
* The triples ``[logprob, token_id, null]`` are read straight into arrays by the C reader
  (`native.triples`), each log-prob the double orjson gives; a list it refuses (another
  shape, a number it does not convert exactly) is `NotFast`. The top-k rows and the prompt's
  ids (small, or asked for only with ``--topk``) are read by orjson from their spans.

A non-streamed answer or a stream chunk for one sample is captured by `FastSample`; `restore`
cuts what the proxy added out of the bytes. Both refuse anything they cannot do exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from ....monitor.core.errors import NotFast
from .. import native
from ..records import RolloutRecord, topk_entropy_bounds, version_runs
from .keyspan import (
    _LB,
    Hole,
    _int_value,
    _u8,
    finished,
    stream_index,
    value_span,
)
from .wire import RequestPlan, SampleState, WireError, finish_type

__all__ = ["NotFast", "FastSample", "restore", "finished", "value_span", "stream_index"]

# The logprob-bearing keys SGLang writes into meta_info (sglang_wire._LOGPROB_PREFIXES).
_LOGPROB_KEYS = (
    b"input_token_logprobs",
    b"output_token_logprobs",
    b"output_token_logprobs_length",
    b"input_top_logprobs",
    b"output_top_logprobs",
    b"input_token_ids_logprobs",
    b"output_token_ids_logprobs",
)
_TOP_KEYS = (b"input_top_logprobs", b"output_top_logprobs")
# Values cut out before the rest of a finished chunk is parsed for its small fields.
_BULK_KEYS = (
    b"output_ids",
    b"prompt_token_ids",
    b"input_token_logprobs",
    b"output_token_logprobs",
    b"input_top_logprobs",
    b"output_top_logprobs",
)


def _triples(buf: bytes, key: bytes) -> tuple[np.ndarray, np.ndarray, tuple[int, int]] | None:
    """Ids, log-probs and the list's span (a `Hole`), read by the C reader."""
    pat = b'"' + key + b'":'
    k = buf.find(pat)
    if k < 0:
        return None
    v = k + len(pat)
    count, end, ids, logps = native.triples(buf, v)
    if count < 0:
        raise NotFast(f"{key.decode()}: not [[logprob,id,null],...] with exact numbers")
    return ids, logps, (v, end)


def _top_logps(buf: bytes, n: int, hole: Hole = None) -> np.ndarray | None:
    """``output_top_logprobs`` as an ``(n, k)`` array; refuses null or ragged rows."""
    span = value_span(buf, b"output_top_logprobs", hole=hole)
    if span is None:
        return None
    try:
        rows = orjson.loads(buf[span[1] : span[2]])
        values = np.array([[t[0] for t in row] for row in rows], dtype=np.float64)
    except (orjson.JSONDecodeError, TypeError, ValueError, IndexError, KeyError):
        raise NotFast("top-k rows are null, ragged or not triples") from None
    if values.ndim != 2 or values.shape[0] != n or len(rows) != n:
        raise NotFast("top-k rows are null or ragged, or not one per token")
    return values


# Bytes one [logprob,id,null] triple takes in a list, at least and at most (a 24-character
# log-prob, an 18-digit id, brackets, commas): a list's byte length bounds its triple count.
MIN_TRIPLE, MAX_TRIPLE = 10, 52


@dataclass
class FastSample:
    """One sample's arrays over stream chunks (cumulative or incremental) or one answer.

    Mirrors `sglang_wire.SampleState`: a chunk whose list is as long as
    ``output_token_logprobs_length`` replaces what came before (cumulative; kept by reference
    and only read if a delta or the last chunk needs it), a shorter one extends it."""

    ids: list[np.ndarray] = field(default_factory=list)
    logps: list[np.ndarray] = field(default_factory=list)
    tops: list[np.ndarray] | None = None
    n: int = 0
    total: int = 0
    prompt: np.ndarray | None = None
    pending: bytes | None = None
    # a cumulative chunk held as (read buffer, start, end), cut out only if it is ever read
    lazy: tuple[bytes, int, int] | None = None
    # the answer `take_answer` read and its log-prob list's span, skipped by key searches
    hole: tuple[bytes, int, int] | None = field(default=None, repr=False)

    def offer(self, frame: bytes, *, last: bool) -> None:
        total = _int_value(frame, b"output_token_logprobs_length")
        if total is None:
            raise NotFast("no output_token_logprobs_length (SGLang before 0.5.3)")
        prev, self.total = self.total, total
        if not last and self._cumulative(frame, total, total - prev):
            self.pending, self.lazy = frame, None
            return
        ids, logps, top = self._parse(frame)
        self._keep_chunk(ids, logps, top, total)
        self._prompt(frame)

    def hold(self, buf: bytes, lo: int, hi: int, total: int) -> None:
        """An unfinished chunk ``buf[lo:hi]`` the caller found to hold all ``total`` tokens
        so far (`offer` with a cumulative chunk, without copying it out of ``buf``)."""
        self.total, self.pending, self.lazy = total, None, (buf, lo, hi)

    def offer_delta(self, ids: np.ndarray, logps: np.ndarray, total: int) -> None:
        """An unfinished chunk already read (by `native.scan_deltas`): same rules as `offer`."""
        self.total = total
        self._keep_chunk(ids, logps, None, total)

    def _keep_chunk(
        self, ids: np.ndarray, logps: np.ndarray, top: np.ndarray | None, total: int
    ) -> None:
        """Keep one chunk's tokens: a whole (cumulative) chunk replaces what was held, a delta
        extends it; a cumulative chunk held back unparsed is read first when a delta follows."""
        if len(ids) != total and self.lazy is not None:
            buf, lo, hi = self.lazy
            self.pending = buf[lo:hi]
        if len(ids) != total and self.pending is not None:
            self._keep(*self._parse(self.pending), delta=False)
        self.pending = self.lazy = None
        delta = self.n > 0 and len(ids) != total
        if delta and self.n + len(ids) != total:
            raise WireError(
                f"meta_info.output_token_logprobs_length: {total} is neither the chunk's "
                f"{len(ids)} tokens nor {self.n} seen + {len(ids)}"
            )
        self._keep(ids, logps, top, delta=delta)

    def to_objects(self) -> SampleState:
        """What this sample holds so far, as the object path holds it: a chunk this path
        refuses mid-stream goes on there (`SampleState.offer`), with the tokens read before."""
        state = SampleState()
        if self.n:
            state.ids = np.concatenate(self.ids).tolist()
            state.logps = np.concatenate(self.logps).tolist()
        if self.tops is not None:
            state.tops = [row for rows in self.tops for row in rows.tolist()]
        if self.prompt is not None:
            state.prompt_ids = self.prompt.tolist()
        pending = self.pending
        if self.lazy is not None:
            buf, lo, hi = self.lazy
            pending = buf[lo:hi]
        if pending is not None:
            out = orjson.loads(pending)
            state.pending = {
                "meta_info": dict(out["meta_info"]),
                "prompt_token_ids": out.get("prompt_token_ids"),
            }
        return state

    def take_answer(self, answer: bytes) -> None:
        ids, logps, top, hole = _read(answer)
        self._keep(ids, logps, top, delta=False)
        self.hole = (answer, *hole)
        self._prompt(answer)

    def _hole_in(self, buf: bytes) -> Hole:
        return self.hole[1:] if self.hole is not None and self.hole[0] is buf else None

    @staticmethod
    def _cumulative(frame: bytes, total: int, delta: int) -> bool:
        """Whether a chunk holds all ``total`` tokens so far (else only the ``delta`` new ones),
        from its list's byte length where that decides it, else by counting triples."""
        if delta == total:
            return True  # the first chunk: both readings agree
        span = value_span(frame, b"output_token_logprobs", check=False)
        if span is None:
            raise WireError("meta_info.output_token_logprobs: missing (return_logprob off?)")
        length = span[2] - span[1]
        if length < MIN_TRIPLE * total:
            return False
        if length > MAX_TRIPLE * delta + 2:
            return True
        arr = _u8(frame)[span[1] : span[2]]
        return int(np.count_nonzero(arr == _LB)) - 1 == total

    @staticmethod
    def _parse(buf: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        return _read(buf)[:3]

    def _keep(
        self, ids: np.ndarray, logps: np.ndarray, top: np.ndarray | None, *, delta: bool
    ) -> None:
        if not delta:
            self.ids, self.logps, self.n = [], [], 0
            if top is not None:
                self.tops = []
        self.ids.append(ids)
        self.logps.append(logps)
        self.n += len(ids)
        if top is not None:
            self.tops = (self.tops or []) + [top]

    def _prompt(self, buf: bytes) -> None:
        span = value_span(buf, b"prompt_token_ids", hole=self._hole_in(buf))
        if span is None:
            return
        try:
            values = np.array(orjson.loads(buf[span[1] : span[2]]))
        except (orjson.JSONDecodeError, ValueError):
            raise NotFast("prompt_token_ids: not a list of ints") from None
        if values.ndim != 1 or (values.size and values.dtype.kind != "i"):
            raise NotFast("prompt_token_ids: not a list of ints")
        self.prompt = values.astype(np.int64)

    def record(
        self,
        last: bytes,
        *,
        fallback_prompt: list[int] | None,
        vocab_size: int | None,
    ) -> RolloutRecord:
        meta = _small_meta(last, self._hole_in(last))
        rid = meta.get("id")
        if not isinstance(rid, str):
            raise WireError(f"meta_info.id: expected a string, got {rid!r}")
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)
        logp = np.concatenate(self.logps) if self.logps else np.zeros(0)
        wv = meta.get("weight_version")
        wv = None if wv is None else str(wv)
        lower = tail = None
        source = None
        if self.tops is not None and self.n:
            tops = np.concatenate(self.tops)
            if tops.shape == (self.n, tops.shape[1]) and tops.shape[1] > 0:
                lower, tail = topk_entropy_bounds(tops, vocab_size=vocab_size)
                source = "topk"
        prompt = self.prompt
        if prompt is None and fallback_prompt is not None:
            prompt = np.array(fallback_prompt, dtype=np.int64)
        reason = meta.get("finish_reason")
        return RolloutRecord(
            rid=rid,
            input_ids=prompt,
            output_ids=ids,
            logp=logp,
            runs=version_runs(meta.get("weight_versions"), self.n, wv),
            finish_reason=finish_type(reason),
            weight_version=wv,
            entropy_lower=lower,
            entropy_tail=tail,
            entropy_source=source,
        )


def _read(buf: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[int, int]]:
    """Ids, log-probs, top-k rows and the `Hole` of ``output_token_logprobs``."""
    got = _triples(buf, b"output_token_logprobs")
    if got is None:
        raise WireError("meta_info.output_token_logprobs: missing (return_logprob off?)")
    ids, logps, hole = got
    return ids, logps, _top_logps(buf, len(ids), hole), hole


def _small_meta(buf: bytes, hole: Hole = None) -> dict[str, Any]:
    """``meta_info`` of one sample with its bulk lists cut out, parsed."""
    cuts = sorted(s for key in _BULK_KEYS if (s := value_span(buf, key, hole=hole)) is not None)
    parts, at = [], 0
    for _, v, e in cuts:
        parts += [buf[at:v], b"0"]
        at = e
    parts.append(buf[at:])
    try:
        out = orjson.loads(b"".join(parts))
    except orjson.JSONDecodeError:
        raise NotFast("answer is not one JSON object") from None
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict):
        raise WireError(f"meta_info: expected an object, got {meta!r}")
    return meta


def _without(buf: bytes, k: int, e: int) -> tuple[int, int]:
    """The byte range to delete for the member ``"key":value`` at ``buf[k:e]``."""
    if buf[k - 1 : k] != b",":
        raise NotFast("a removed member is the first of its object")
    return k - 1, e


def restore(buf: bytes, plan: RequestPlan, item: int) -> bytes:
    """One sample's answer or chunk as the client's own request would have had it."""
    cuts: list[tuple[int, int, bytes]] = []
    hole: Hole = None
    if not plan.want_logprob[item]:
        # the log-prob list, checked once, is skipped by every other key's search
        span = value_span(buf, b"output_token_logprobs")
        hole = None if span is None else (span[1], span[2])
        cuts += _drops(buf, _LOGPROB_KEYS, hole)
    elif plan.raised_topk:
        k0 = plan.want_topk[item]
        if k0 <= 0:
            cuts += _drops(buf, _TOP_KEYS)
        else:
            for key in _TOP_KEYS:
                span = value_span(buf, key)
                if span is None:
                    continue
                rows = orjson.loads(buf[span[1] : span[2]])
                if isinstance(rows, list):
                    rows = [r[:k0] if isinstance(r, list) else r for r in rows]
                cuts.append((span[1], span[2], orjson.dumps(rows)))
    if plan.added_prompt_ids:
        span = value_span(buf, b"prompt_token_ids", hole=hole)
        if span is not None:
            cuts.append((*_without(buf, span[0], span[2]), b""))
    if not cuts:
        return buf
    cuts.sort()
    parts, at = [], 0
    for lo, hi, new in cuts:
        if lo < at:
            raise NotFast("overlapping members")
        parts += [buf[at:lo], new]
        at = hi
    parts.append(buf[at:])
    return b"".join(parts)


def _drops(buf: bytes, keys: tuple[bytes, ...], hole: Hole = None) -> list[tuple[int, int, bytes]]:
    out = []
    for key in keys:
        span = value_span(buf, key, hole=hole)
        if span is not None:
            out.append((*_without(buf, span[0], span[2]), b""))
    return out
