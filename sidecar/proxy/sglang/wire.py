"""SGLang 0.5.x ``/generate`` wire format: rewrite requests, restore answers, collect samples.

Verified against SGLang's source (0.5.23 wheel; 0.5.2 for the older differences):
``srt/managers/io_struct.py`` (GenerateReqInput), ``srt/managers/tokenizer_manager.py``
(``_handle_batch_output``, ``add_logprob_to_meta_info``, ``detokenize_logprob_tokens``,
``_handle_abort_req``, ``_stream_batch_responses``), ``srt/entrypoints/http_server.py``
(``generate_request``: ``data: <json>\\n\\n`` frames closed by ``data: [DONE]``),
``srt/utils/weight_versions.py`` (``add_weight_versions_to_meta_info``) and
``sglang/api/v1/api_types.py`` (GenerateMetaInfo, FinishStop/Length/Abort, WeightVersionSpan).

Facts this module relies on:

* ``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text|null]`` (text is
  null unless ``return_text_in_logprobs``); ``output_token_logprobs_length`` is its cumulative
  length (0.5.2 lacks this key). ``output_top_logprobs`` has one entry per output token: a list
  of triples sorted by logprob (``torch.topk``) or null.
* Streaming is cumulative by default; with ``--incremental-streaming-output`` the output-side
  lists (``output_token_logprobs``, ``output_top_logprobs``, ``output_token_ids_logprobs``) and
  ``output_ids``/``text`` are deltas, while ``weight_versions`` and
  ``output_token_logprobs_length`` stay cumulative. An abort answer carries the *full* lists
  even in incremental mode, so the mode is decided per chunk from the lengths.
* ``weight_versions`` (0.5.2 lacks it) is ``[{"version": str, "start": int, "end": int}]`` over
  output token positions, end exclusive; ``weight_version`` is the last span's version.
* ``return_prompt_token_ids`` (0.5.2 lacks it; unknown keys are ignored) adds
  ``prompt_token_ids`` beside ``output_ids``; with ``return_logprob`` and the default
  ``logprob_start_len = -1`` SGLang returns no input logprobs.
* Batch requests (list ``text`` / list of ``input_ids``) answer a list ordered prompt-major
  (``n`` samples per prompt); streamed batch chunks carry ``"index"`` into that order.
* SGLang never returns entropy: ``return_entropy`` is accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson

from ....monitor.core.errors import WireError
from ..records import RolloutRecord, topk_entropy_bounds, version_runs

__all__ = [
    "LOGPROB_PREFIXES",
    "TOP_KEYS",
    "WireError",
    "parse_logprob_triples",
    "RequestPlan",
    "plan_request",
    "Chunk",
    "SampleState",
    "read_object",
    "finish_type",
    "dumps",
    "loads",
    "is_finished",
    "outputs_of",
]

#: the meta_info keys that hold log-probs (as prefixes), and those that hold top-k rows
LOGPROB_PREFIXES = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)
TOP_KEYS = ("input_top_logprobs", "output_top_logprobs")
_FLAT_FLAGS = (
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
)


def dumps(obj: Any) -> bytes:
    """Compact JSON exactly as SGLang writes it (orjson: no spaces, UTF-8, key order kept), so
    restored answers are byte-identical."""
    return orjson.dumps(obj)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def _per_item(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, list) else value


@dataclass
class RequestPlan:
    """What the proxy changed in one ``/generate`` request, and how to undo it per sample."""

    body: dict[str, Any]
    num_prompts: int
    n: int
    stream: bool
    want_logprob: list[bool]
    want_topk: list[int]
    added_logprob: bool
    raised_topk: bool
    added_prompt_ids: bool
    client_input_ids: list[list[int]] | None

    @property
    def changed(self) -> bool:
        return self.added_logprob or self.raised_topk or self.added_prompt_ids

    def prompt_index(self, output_index: int) -> int:
        return min(output_index // max(self.n, 1), self.num_prompts - 1)

    def restore(self, out: dict[str, Any], output_index: int) -> None:
        """Turn one sample's answer (or stream chunk) back into what the client asked for."""
        if self.added_prompt_ids:
            out.pop("prompt_token_ids", None)
        meta = out.get("meta_info")
        if not isinstance(meta, dict):
            return
        item = self.prompt_index(output_index)
        if not self.want_logprob[item]:
            for key in [k for k in meta if k.startswith(LOGPROB_PREFIXES)]:
                del meta[key]
            return
        if not self.raised_topk:
            return
        k0 = self.want_topk[item]
        if k0 <= 0:
            for key in [k for k in meta if k.startswith(TOP_KEYS)]:
                del meta[key]
            return
        for key in TOP_KEYS:
            rows = meta.get(key)
            if isinstance(rows, list):
                meta[key] = [row[:k0] if isinstance(row, list) else row for row in rows]


def plan_request(body: Any, topk: int | None) -> RequestPlan | None:
    """Rewrite a ``/generate`` body to return what the sidecar needs; None if not a request
    the sidecar understands (it is then forwarded untouched and nothing is captured)."""
    if not isinstance(body, dict):
        return None
    text, input_ids = body.get("text"), body.get("input_ids")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            return None
        is_batch = isinstance(input_ids[0], list)
        prompts_ids: list[list[int]] | None = input_ids if is_batch else [input_ids]
        num_prompts = len(input_ids) if is_batch else 1
    elif text is not None:
        is_batch = isinstance(text, list)
        prompts_ids = None
        num_prompts = len(text) if is_batch else 1
    else:
        return None
    if num_prompts == 0:
        return None
    sp = body.get("sampling_params")
    sp0 = sp[0] if isinstance(sp, list) and sp else sp
    n = int(sp0.get("n", 1) or 1) if isinstance(sp0, dict) else 1

    new = dict(body)
    rl, tk = body.get("return_logprob"), body.get("top_logprobs_num")
    want_logprob = [bool(_per_item(rl, i)) for i in range(num_prompts)]
    want_topk = [int(_per_item(tk, i) or 0) if want_logprob[i] else 0 for i in range(num_prompts)]
    added_logprob = not all(want_logprob)
    if added_logprob:
        new["return_logprob"] = True
        if not any(want_logprob):
            # SGLang ignores these without return_logprob; keep them from costing anything now.
            if not isinstance(body.get("logprob_start_len"), list):
                new.pop("logprob_start_len", None)
            if body.get("return_text_in_logprobs"):
                new["return_text_in_logprobs"] = False
            new.pop("token_ids_logprob", None)
    raised_topk = False
    if topk and not any(body.get(flag) for flag in _FLAT_FLAGS):
        raised: int | list[int] = (
            [max(int(v or 0), topk) for v in tk]
            if isinstance(tk, list)
            else max(int(tk or 0), topk)
        )
        raised_topk = any(k < topk for k in want_topk)
        if raised_topk or added_logprob:
            new["top_logprobs_num"] = raised
            raised_topk = True
    added_prompt_ids = input_ids is None and not body.get("return_prompt_token_ids")
    if added_prompt_ids:
        new["return_prompt_token_ids"] = True
    return RequestPlan(
        body=new,
        num_prompts=num_prompts,
        n=n,
        stream=bool(body.get("stream")),
        want_logprob=want_logprob,
        want_topk=want_topk,
        added_logprob=added_logprob,
        raised_topk=raised_topk,
        added_prompt_ids=added_prompt_ids,
        client_input_ids=prompts_ids,
    )


def parse_logprob_triples(entries: Any, where: str) -> tuple[list[int], list[float | None]]:
    if not isinstance(entries, list):
        raise WireError(f"{where}: expected a list, got {type(entries).__name__}")
    ids: list[int] = []
    logps: list[float | None] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise WireError(f"{where}[{i}]: expected [logprob, token_id, text], got {entry!r}")
        lp, tid = entry[0], entry[1]
        if not isinstance(tid, int) or isinstance(tid, bool):
            raise WireError(f"{where}[{i}][1]: token id must be an int, got {tid!r}")
        if lp is not None and not isinstance(lp, (int, float)):
            raise WireError(f"{where}[{i}][0]: logprob must be a number, got {lp!r}")
        ids.append(tid)
        logps.append(None if lp is None else float(lp))
    return ids, logps


def _top_rows(rows: Any, where: str) -> list[list[float | None] | None]:
    if not isinstance(rows, list):
        raise WireError(f"{where}: expected a list, got {type(rows).__name__}")
    return [
        None if row is None else parse_logprob_triples(row, f"{where}[{i}]")[1]
        for i, row in enumerate(rows)
    ]


def finish_type(reason: Any) -> str | None:
    """SGLang's ``finish_reason`` (a dict with ``type``, a string or None) as its type name."""
    if isinstance(reason, dict):
        reason = reason.get("type")
    return None if reason is None else str(reason)


#: Top-k rows of a chunk: an ``(n, k)`` array (the byte path), or one list of log-probs per
#: token, None where SGLang sent no row (the object path).
TopRows = np.ndarray | list[list[float | None] | None]


class Chunk(NamedTuple):
    """What one answer or stream chunk holds of its sample, whichever reader read it: arrays
    (the byte path) or lists (the object path, where ``None`` is a null log-prob, refused when
    the record is built). ``total`` is ``output_token_logprobs_length`` (None before SGLang
    0.5.3)."""

    ids: np.ndarray | list[int]
    logps: np.ndarray | list[float | None]
    tops: TopRows | None = None
    total: int | None = None
    prompt: np.ndarray | list[int] | None = None


def _joined(parts: list[Any], dtype: type) -> np.ndarray:
    """One array of the chunks' arrays or lists (None in a float list: NaN)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    flat = [x for p in parts for x in (p.tolist() if isinstance(p, np.ndarray) else p)]
    return np.array(flat, dtype=dtype)


def read_object(out: Mapping[str, Any]) -> Chunk:
    """The object path's reader: one parsed answer or chunk (orjson's objects)."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        raise WireError(f"meta_info: expected an object, got {meta!r}")
    if "output_token_logprobs" not in meta:
        raise WireError("meta_info.output_token_logprobs: missing (return_logprob off?)")
    ids, logps = parse_logprob_triples(
        meta["output_token_logprobs"], "meta_info.output_token_logprobs"
    )
    tops = (
        _top_rows(meta["output_top_logprobs"], "meta_info.output_top_logprobs")
        if "output_top_logprobs" in meta
        else None
    )
    if tops is not None and len(tops) != len(ids):
        raise WireError(f"meta_info.output_top_logprobs: {len(tops)} rows for {len(ids)} tokens")
    prompt = out.get("prompt_token_ids")
    total = meta.get("output_token_logprobs_length")
    return Chunk(
        ids,
        logps,
        tops,
        total if isinstance(total, int) else None,
        [int(t) for t in prompt] if isinstance(prompt, list) else None,
    )


class SampleState:
    """One sample's tokens over stream chunks (cumulative or incremental) or one answer, read
    by either reader: the object path's `read_object` or the byte path's
    (`proxy.sglang.fastwire.read_bytes`, `native.scan_deltas`). A sample whose chunk the byte
    path refuses goes on on the object path with what it holds.

    A chunk whose list is as long as ``output_token_logprobs_length`` holds every token so far
    (cumulative): it replaces what came before. A shorter one is a delta and extends it; one
    that is neither is a `WireError`. Before SGLang 0.5.3 (no length) a chunk that repeats the
    tokens held is cumulative. An unfinished cumulative chunk is superseded by the next one,
    so it is only held (`hold`) and read when a delta or the last chunk needs it."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray | list[int]] = []
        self.logps: list[np.ndarray | list[float | None]] = []
        self.tops: list[TopRows] | None = None
        self.n = 0
        self.total = 0  # output_token_logprobs_length of the last chunk seen
        self.prompt: np.ndarray | list[int] | None = None
        self.pending: Callable[[], Chunk] | None = None

    def hold(self, read: Callable[[], Chunk], total: int) -> None:
        """An unfinished cumulative chunk of ``total`` tokens, read by ``read`` if ever needed."""
        self.pending, self.total = read, total

    def offer(self, out: Mapping[str, Any]) -> None:
        """Take one parsed stream chunk (the object path)."""
        meta = out.get("meta_info")
        if isinstance(meta, dict) and meta.get("finish_reason") is None and _is_whole(out):
            held = {"meta_info": dict(meta), "prompt_token_ids": out.get("prompt_token_ids")}
            self.hold(lambda: read_object(held), meta["output_token_logprobs_length"])
            return
        self.add(read_object(out))

    def feed(self, out: Mapping[str, Any], *, stream: bool) -> None:
        """Take one parsed answer (``stream=False``) or stream chunk, read now."""
        self.add(read_object(out), stream=stream)

    def add(self, chunk: Chunk, *, stream: bool = True) -> None:
        """Take one chunk read now: it replaces or extends what is held (see the class doc)."""
        n, total = len(chunk.ids), chunk.total
        if not stream:
            whole = True
        elif total is not None:
            whole = n == total
        else:  # SGLang before 0.5.3: a cumulative chunk repeats the prefix
            held = _joined(self.ids, np.int64)
            whole = n >= len(held) and np.array_equal(np.asarray(chunk.ids)[: len(held)], held)
        if not whole and self.pending is not None:
            last = self.pending()
            if last.total is not None and len(last.ids) != last.total:
                raise WireError(
                    f"meta_info.output_token_logprobs_length: {last.total} for a held chunk "
                    f"of {len(last.ids)} tokens"
                )
            self._keep(last, whole=True)
        self.pending = None
        if not whole and total is not None and self.n + n != total:
            raise WireError(
                f"meta_info.output_token_logprobs_length: {total} is neither the chunk's "
                f"{n} tokens nor {self.n} seen + {n}"
            )
        self._keep(chunk, whole=whole)
        if total is not None:
            self.total = total

    def _keep(self, chunk: Chunk, *, whole: bool) -> None:
        if whole:
            self.ids, self.logps, self.n = [], [], 0
        self.ids.append(chunk.ids)
        self.logps.append(chunk.logps)
        self.n += len(chunk.ids)
        if chunk.tops is not None:
            if whole or self.tops is None:
                self.tops = []
            self.tops.append(chunk.tops)
        if chunk.prompt is not None:
            self.prompt = chunk.prompt

    def _top_rows(self) -> np.ndarray | list[list[float | None]] | None:
        """The top-k rows of every token held, None unless each token has a non-empty one."""
        parts = self.tops
        if not parts or not self.n:
            return None
        arrays = [p for p in parts if isinstance(p, np.ndarray)]
        if len(arrays) == len(parts):
            rows = np.concatenate(arrays)
            return rows if rows.shape == (self.n, rows.shape[1]) and rows.shape[1] else None
        listed: list[list[float | None]] = []
        for p in parts:
            for row in p.tolist() if isinstance(p, np.ndarray) else p:
                if not row:
                    return None  # a token without a top-k row: no bound
                listed.append(row)
        return listed if len(listed) == self.n else None

    def record(
        self,
        meta: Mapping[str, Any],
        *,
        fallback_prompt: list[int] | None,
        vocab_size: int | None,
    ) -> RolloutRecord:
        """The finished sample as a record; ``meta`` is its last chunk's ``meta_info``."""
        rid = meta.get("id")
        if not isinstance(rid, str):
            raise WireError(f"meta_info.id: expected a string, got {rid!r}")
        ids, logp = _joined(self.ids, np.int64), _joined(self.logps, np.float64)
        nulls = np.flatnonzero(np.isnan(logp))
        if nulls.size:
            raise WireError(f"meta_info.output_token_logprobs[{nulls[0]}][0]: logprob is null")
        wv = meta.get("weight_version")
        wv = None if wv is None else str(wv)
        lower = tail = source = None
        rows = self._top_rows()
        if rows is not None:
            lower, tail = topk_entropy_bounds(rows, vocab_size=vocab_size)
            source = "topk"
        prompt = self.prompt if self.prompt is not None else fallback_prompt
        return RolloutRecord(
            rid=rid,
            input_ids=prompt,
            output_ids=ids,
            logp=logp,
            runs=version_runs(meta.get("weight_versions"), self.n, wv),
            finish_reason=finish_type(meta.get("finish_reason")),
            weight_version=wv,
            entropy_lower=lower,
            entropy_tail=tail,
            entropy_source=source,
        )


def _is_whole(out: Mapping[str, Any]) -> bool:
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        return False
    total, entries = meta.get("output_token_logprobs_length"), meta.get("output_token_logprobs")
    return isinstance(total, int) and isinstance(entries, list) and len(entries) == total


def is_finished(out: Mapping[str, Any]) -> bool:
    meta = out.get("meta_info")
    return isinstance(meta, dict) and meta.get("finish_reason") is not None


def outputs_of(answer: Any, where: str = "answer") -> Sequence[Any]:
    """The per-sample objects of a non-streamed answer (a list for batch requests)."""
    if isinstance(answer, list):
        return answer
    if isinstance(answer, dict):
        return [answer]
    raise WireError(f"{where}: expected an object or a list, got {type(answer).__name__}")
