"""vLLM's OpenAI-compatible answers read and restored on their bytes.

The proxy asks vLLM for what the sidecar needs (`plan_request`): the sampled token's log-prob
(``logprobs: 0`` on completions and ``/inference/v1/generate``, ``logprobs: true`` on chat) and
the token ids (``return_token_ids: true``). vLLM writes every field of its answer models, so a
field the client did not ask for is present as ``null`` (non-streamed: ``model_dump()``;
streamed: ``model_dump_json(exclude_unset=True)`` with the field passed explicitly). Restoring
an answer therefore replaces the added members' values by ``null`` in place (`edit_answer`); all
other bytes are the upstream's. The structure is walked by `proxy.jsonbytes.span`, so a string that
happens to contain a key never matches.

What is read per choice (object path: none; nothing here builds per-token Python objects):

* ids: ``choices[i].token_ids``; log-probs: ``choices[i].logprobs.token_logprobs``
  (completions) or each ``choices[i].logprobs.content[t].logprob`` (chat, generate);
* prompt ids: ``choices[i].prompt_token_ids`` (completions), top-level ``prompt_token_ids``
  (chat) or the request's ``token_ids`` (generate);
* weight versions: ``weight_versions: [{version, start, end}]`` / ``weight_version`` on the
  choice or the answer (``/inference/v1/generate`` with ``--enable-scale-out``).

vLLM writes a log-prob of ``-inf`` as ``-9999.0`` (its OpenAI layer clamps it); the proxy reads
any value ≤ -9999 back as ``-inf`` (a token the engine gave probability 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from ....monitor.core.errors import NotFast, WireError
from ..jsonbytes.scan import scan_ints
from ..jsonbytes.span import member_numbers, u8, walk

__all__ = [
    "KINDS",
    "VllmPlan",
    "ChoicePart",
    "plan_request",
    "edit_answer",
    "SAMPLING_KEYS",
    "CLAMPED_LOGPROB",
    "warm_up",
]

KINDS = ("completions", "chat", "generate")
#: The request keys recorded with each sample (the rest of the sampling parameters do not
#: change which distribution the sampled token came from).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed")
#: vLLM's OpenAI layer writes -inf as this value.
CLAMPED_LOGPROB = -9999.0
_LOGPROB = np.frombuffer(b"logprob", dtype=np.uint8).copy()


@dataclass
class VllmPlan:
    """One request as the proxy forwards it, and what to undo in its answer."""

    kind: str
    body: dict[str, Any]
    changed: bool
    stream: bool
    cut_logprobs: bool
    cut_ids: bool
    prompt_ids: list[int] | None
    sampling: dict[str, Any]


@dataclass
class ChoicePart:
    """What one answer or stream chunk holds for one choice."""

    index: int
    ids: np.ndarray
    logps: np.ndarray
    finish_reason: str | None
    prompt: np.ndarray | None = None
    spans: Any = None
    version: str | None = None
    bare: bool = False  # a chat stream chunk vLLM sends only for the added fields


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def plan_request(kind: str, body: Any) -> VllmPlan | None:
    """The forwarded body for a completions / chat / generate request; None when the proxy
    leaves the request alone (not a JSON object, echo, beam search, a client that asked for
    top-k without log-probs: vLLM's own answer to those is passed through untouched)."""
    if kind not in KINDS:
        raise ValueError(f"unknown vLLM endpoint kind {kind!r}")
    if not isinstance(body, dict):
        return None
    out = dict(body)
    cut_logprobs = cut_ids = False
    prompt_ids: list[int] | None = None
    if kind == "generate":
        params = body.get("sampling_params")
        if not isinstance(params, dict) or not _is_int_list(body.get("token_ids")):
            return None
        prompt_ids = list(body["token_ids"])
        sampling = {k: params.get(k) for k in SAMPLING_KEYS}
        if params.get("logprobs") is None:
            out["sampling_params"] = dict(params, logprobs=0)
            cut_logprobs = True
    else:
        if body.get("echo") or body.get("use_beam_search"):
            return None
        sampling = {k: body.get(k) for k in SAMPLING_KEYS}
        if kind == "completions":
            if body.get("logprobs") is None:
                out["logprobs"] = 0
                cut_logprobs = True
        else:
            if body.get("top_logprobs") not in (None, 0) and not body.get("logprobs"):
                return None  # vLLM refuses this itself
            if not body.get("logprobs"):
                out["logprobs"] = True
                cut_logprobs = True
        if body.get("return_token_ids") is not True:
            out["return_token_ids"] = True
            cut_ids = True
    return VllmPlan(
        kind=kind,
        body=out,
        changed=cut_logprobs or cut_ids,
        stream=bool(body.get("stream")),
        cut_logprobs=cut_logprobs,
        cut_ids=cut_ids,
        prompt_ids=prompt_ids,
        sampling=sampling,
    )


class _Tree:
    """`jsonspan.walk`'s rows as lookups: members by container row and key, items in order."""

    def __init__(self, buf: bytes, arr: np.ndarray) -> None:
        rows = walk(arr, 4, 2)  # down to choices[i].logprobs' members
        if rows.shape[0] == 0:
            raise NotFast("not one JSON object")
        self.buf = buf
        self.spans: list[tuple[int, int]] = []
        self.members: dict[tuple[int, bytes], int] = {}
        self.items: dict[int, list[int]] = {}
        for r, (parent, _d, ks, ke, vs, ve, _i) in enumerate(rows.tolist()):
            self.spans.append((vs, ve))
            if ks >= 0:
                self.members[(parent, buf[ks:ke])] = r
            elif parent >= 0:
                self.items.setdefault(parent, []).append(r)

    def get(self, row: int, key: bytes) -> tuple[int, int] | None:
        r = self.members.get((row, key))
        return None if r is None else self.spans[r]

    def row(self, row: int, key: bytes) -> int | None:
        return self.members.get((row, key))


def _ints(buf: bytes, arr: np.ndarray, span: tuple[int, int], where: str) -> np.ndarray:
    count, end, values = scan_ints(arr, span[0])
    if count >= 0 and end == span[1]:
        return values.copy()
    try:
        obj = orjson.loads(buf[span[0] : span[1]])
    except orjson.JSONDecodeError:
        raise WireError(f"{where}: not JSON") from None
    if not isinstance(obj, list):
        raise WireError(f"{where}: expected a list of token ids (send return_token_ids: true)")
    try:
        return np.array(obj, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise WireError(f"{where}: token ids must be ints") from None


def _floats(text: bytes, where: str) -> np.ndarray:
    try:
        values = orjson.loads(text)
        out = np.array(values, dtype=np.float64)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        raise WireError(f"{where}: log-probs must be numbers") from None
    if out.ndim != 1:
        raise WireError(f"{where}: expected a list of numbers")
    out[out <= CLAMPED_LOGPROB] = -np.inf
    return out


def _logps(tree: _Tree, arr: np.ndarray, lp_row: int, kind: str, where: str) -> np.ndarray:
    buf = tree.buf
    if kind == "completions":
        got = tree.get(lp_row, b"token_logprobs")
        if got is None:
            raise WireError(f"{where}.token_logprobs: missing")
        return _floats(buf[got[0] : got[1]], f"{where}.token_logprobs")
    got = tree.get(lp_row, b"content")
    if got is None:
        raise WireError(f"{where}.content: missing")
    if buf[got[0] : got[1]] == b"null":
        return np.zeros(0)
    count, text = member_numbers(arr, got[0], _LOGPROB)
    if count < 0:
        raise WireError(f"{where}.content: not a list of {{logprob: number}} objects")
    return _floats(text.tobytes(), f"{where}.content[].logprob")


def _small(buf: bytes, span: tuple[int, int] | None) -> Any:
    if span is None:
        return None
    try:
        return orjson.loads(buf[span[0] : span[1]])
    except orjson.JSONDecodeError:
        raise NotFast("not JSON") from None


def edit_answer(
    buf: bytes, plan: VllmPlan, *, read: bool = True
) -> tuple[bytes, list[ChoicePart], dict[str, Any]]:
    """``(client_bytes, parts, top)`` for one answer or stream chunk (a JSON object).

    ``client_bytes`` is ``buf`` with the members the proxy added set to ``null`` (``buf``
    itself, the same object, when nothing was cut). A chat stream chunk whose choices all have
    an empty ``delta`` and no finish reason exists only because of the added fields (vLLM
    skips it otherwise): its parts are marked ``bare`` and the relay drops the frame.
    ``parts`` holds each choice's ids and log-probs (with ``read``); ``top`` the answer's small
    top-level values (``id``, ``request_id``, weight versions). Raises `NotFast` when ``buf``
    is not one JSON object with a ``choices`` list, `WireError` when a choice lacks what was
    asked for."""
    arr = u8(buf)
    tree = _Tree(buf, arr)
    cuts: list[tuple[int, int]] = []
    if plan.cut_ids and (span := tree.get(0, b"prompt_token_ids")) is not None:
        cuts.append(span)
    info: dict[str, Any] = {}
    for key in (b"id", b"request_id", b"weight_version", b"weight_versions"):
        if (span := tree.get(0, key)) is not None:
            info[key.decode()] = _small(buf, span)
    prompt_top = None
    if read and plan.kind == "chat" and (span := tree.get(0, b"prompt_token_ids")) is not None:
        if buf[span[0] : span[1]] != b"null":
            prompt_top = _ints(buf, arr, span, "prompt_token_ids")
            info["prompt_token_ids"] = prompt_top
    choices = tree.row(0, b"choices")
    if choices is None or buf[tree.spans[choices][0]] != 0x5B:
        raise NotFast("no choices list")
    parts: list[ChoicePart] = []
    for c, ch in enumerate(tree.items.get(choices, [])):
        for key, cut in ((b"logprobs", plan.cut_logprobs), (b"token_ids", plan.cut_ids)):
            if cut and (span := tree.get(ch, key)) is not None:
                cuts.append(span)
        if plan.cut_ids and (span := tree.get(ch, b"prompt_token_ids")) is not None:
            cuts.append(span)
        finish = _small(buf, tree.get(ch, b"finish_reason"))
        delta = tree.get(ch, b"delta")
        bare = bool(
            plan.cut_logprobs
            and plan.cut_ids
            and finish is None
            and delta is not None
            and buf[delta[0] : delta[1]] == b"{}"
        )
        if not read:
            if bare:
                parts.append(ChoicePart(0, np.zeros(0, np.int64), np.zeros(0), None, bare=True))
            continue
        where = f"choices[{c}]"
        index = _small(buf, tree.get(ch, b"index"))
        ids_span = tree.get(ch, b"token_ids")
        lp_row = tree.row(ch, b"logprobs")
        lp_span = None if lp_row is None else tree.spans[lp_row]
        no_ids = ids_span is None or buf[ids_span[0] : ids_span[1]] == b"null"
        no_lp = lp_span is None or buf[lp_span[0] : lp_span[1]] == b"null"
        if no_ids and no_lp and plan.stream and finish is None:
            if bare:
                parts.append(ChoicePart(0, np.zeros(0, np.int64), np.zeros(0), None, bare=True))
            continue  # a stream's role-only or empty chunk
        if no_ids or ids_span is None:
            raise WireError(f"{where}.token_ids: missing (send return_token_ids: true)")
        ids = _ints(buf, arr, ids_span, f"{where}.token_ids")
        if lp_row is None:
            raise WireError(f"{where}.logprobs: missing")
        if no_lp:
            if ids.size:
                raise WireError(f"{where}.logprobs: missing (log-probs not returned)")
            logps = np.zeros(0)
        else:
            logps = _logps(tree, arr, lp_row, plan.kind, f"{where}.logprobs")
        if logps.shape != ids.shape:
            raise WireError(f"{where}.logprobs: {logps.size} log-probs for {ids.size} token ids")
        prompt = prompt_top
        if plan.kind == "completions" and (span := tree.get(ch, b"prompt_token_ids")) is not None:
            if buf[span[0] : span[1]] != b"null":
                prompt = _ints(buf, arr, span, f"{where}.prompt_token_ids")
        parts.append(
            ChoicePart(
                index=index if isinstance(index, int) else c,
                ids=ids,
                logps=logps,
                finish_reason=None if finish is None else str(finish),
                prompt=prompt,
                spans=_small(buf, tree.get(ch, b"weight_versions")),
                version=_version(_small(buf, tree.get(ch, b"weight_version"))),
                bare=bare,
            )
        )
    if not cuts:
        return buf, parts, info
    cuts.sort()
    out, at = [], 0
    for lo, hi in cuts:
        if buf[lo:hi] == b"null":
            continue
        out += [buf[at:lo], b"null"]
        at = hi
    if not out:
        return buf, parts, info
    out.append(buf[at:])
    return b"".join(out), parts, info


def warm_up() -> None:
    """Run every compiled walk once (numba compiles, or loads its cache, on first use)."""
    bodies: dict[str, dict[str, Any]] = {
        "completions": {},
        "chat": {},
        "generate": {"token_ids": [], "sampling_params": {}},
    }
    for kind, body in bodies.items():
        plan = plan_request(kind, body)
        assert plan is not None
        lp = (
            b'{"token_logprobs":[-1.0]}'
            if kind == "completions"
            else b'{"content":[{"logprob":-1.0}]}'
        )
        edit_answer(
            b'{"id":"w","choices":[{"index":0,"logprobs":%s,"token_ids":[1],'
            b'"finish_reason":"stop"}]}' % lp,
            plan,
        )


def _version(value: Any) -> str | None:
    return None if value is None else str(value)


def sampling_of(plan: VllmPlan) -> dict[str, Any]:
    """The recorded sampling parameters: only those the request set."""
    return {k: v for k, v in plan.sampling.items() if v is not None}


def truncates(sampling: Mapping[str, Any]) -> bool:
    """Whether sampling with these parameters draws from a distribution other than the raw
    softmax: temperature ≠ 1, top-p < 1, top-k > 0 (vLLM: -1 and 0 mean off), min-p > 0."""
    t, p, k, m = (sampling.get(n) for n in ("temperature", "top_p", "top_k", "min_p"))
    return (
        (isinstance(t, (int, float)) and t != 1.0)
        or (isinstance(p, (int, float)) and p < 1.0)
        or (isinstance(k, int) and k > 0)
        or (isinstance(m, (int, float)) and m > 0.0)
    )
