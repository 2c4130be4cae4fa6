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

`read_bytes` reads a non-streamed answer or a stream chunk into the `wire.Chunk` that the
sample (`wire.SampleState`) takes from either path; `restore` cuts what the proxy added out of
the bytes. Both refuse anything they cannot do exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from ....monitor.core.errors import NotFast
from .. import native
from .keyspan import _LB, Hole, _u8, finished, int_value, value_span
from .wire import LOGPROB_PREFIXES, TOP_KEYS, Chunk, RequestPlan, WireError

__all__ = [
    "NotFast",
    "cumulative",
    "finished",
    "int_value",
    "read_bytes",
    "restore",
    "small_meta",
    "value_span",
]

# The logprob-bearing keys SGLang writes into meta_info: the object path's prefixes, each a
# whole key here, and the one key that only extends a prefix.
_LOGPROB_KEYS = (*(k.encode() for k in LOGPROB_PREFIXES), b"output_token_logprobs_length")
_TOP_KEYS = tuple(k.encode() for k in TOP_KEYS)
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


def read_bytes(buf: bytes) -> tuple[Chunk, Hole]:
    """The byte path's reader: one answer or chunk's ids, log-probs, top-k rows, prompt ids and
    total, and the `Hole` of its log-prob list (skipped by later key searches)."""
    got = _triples(buf, b"output_token_logprobs")
    if got is None:
        raise WireError("meta_info.output_token_logprobs: missing (return_logprob off?)")
    ids, logps, hole = got
    top = _top_logps(buf, len(ids), hole)
    span = value_span(buf, b"prompt_token_ids", hole=hole)
    prompt = None
    if span is not None:
        try:
            values = np.array(orjson.loads(buf[span[1] : span[2]]))
        except (orjson.JSONDecodeError, ValueError):
            raise NotFast("prompt_token_ids: not a list of ints") from None
        if values.ndim != 1 or (values.size and values.dtype.kind != "i"):
            raise NotFast("prompt_token_ids: not a list of ints")
        prompt = values.astype(np.int64)
    return Chunk(ids, logps, top, int_value(buf, b"output_token_logprobs_length"), prompt), hole


def cumulative(frame: bytes, total: int, delta: int) -> bool:
    """Whether an unfinished chunk holds all ``total`` tokens so far (else only the ``delta``
    new ones), from its list's byte length where that decides it, else by counting triples."""
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


def small_meta(buf: bytes, hole: Hole = None) -> dict[str, Any]:
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
        cuts += _drops(buf, (b"prompt_token_ids",), hole)
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
    """The byte ranges that delete each member ``,"key":value`` present (empty replacements)."""
    out = []
    for key in keys:
        span = value_span(buf, key, hole=hole)
        if span is not None:
            if buf[span[0] - 1 : span[0]] != b",":
                raise NotFast("a removed member is the first of its object")
            out.append((span[0] - 1, span[2], b""))
    return out
