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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ....monitor.core.errors import WireError
from ..records import RolloutRecord, topk_entropy_bounds, version_runs

__all__ = [
    "WireError",
    "parse_logprob_triples",
    "RequestPlan",
    "plan_request",
    "SampleState",
    "dumps",
    "loads",
    "is_finished",
    "outputs_of",
]

_LOGPROB_PREFIXES = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)
_TOP_KEYS = ("input_top_logprobs", "output_top_logprobs")
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
    is_batch: bool
    num_prompts: int
    n: int
    stream: bool
    want_logprob: list[bool]
    want_topk: list[int]
    upstream_topk: int
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
            for key in [k for k in meta if k.startswith(_LOGPROB_PREFIXES)]:
                del meta[key]
            return
        if not self.raised_topk:
            return
        k0 = self.want_topk[item]
        if k0 <= 0:
            for key in [k for k in meta if k.startswith(_TOP_KEYS)]:
                del meta[key]
            return
        for key in _TOP_KEYS:
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
    upstream_topk = max(want_topk)
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
        upstream_topk = max(upstream_topk, topk)
    added_prompt_ids = input_ids is None and not body.get("return_prompt_token_ids")
    if added_prompt_ids:
        new["return_prompt_token_ids"] = True
    return RequestPlan(
        body=new,
        is_batch=is_batch,
        num_prompts=num_prompts,
        n=n,
        stream=bool(body.get("stream")),
        want_logprob=want_logprob,
        want_topk=want_topk,
        upstream_topk=upstream_topk,
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
    out: list[list[float | None] | None] = []
    for i, row in enumerate(rows):
        if row is None:
            out.append(None)
        else:
            out.append(parse_logprob_triples(row, f"{where}[{i}]")[1])
    return out


def finish_type(reason: Any) -> str | None:
    """SGLang's ``finish_reason`` (a dict with ``type``, a string or None) as its type name."""
    if reason is None:
        return None
    if isinstance(reason, dict):
        kind = reason.get("type")
        return None if kind is None else str(kind)
    return str(reason)


@dataclass
class SampleState:
    """Accumulates one sample over stream chunks (cumulative or incremental) or one answer."""

    ids: list[int] = field(default_factory=list)
    logps: list[float | None] = field(default_factory=list)
    tops: list[list[float | None] | None] | None = None
    prompt_ids: list[int] | None = None
    pending: dict[str, Any] | None = None

    def offer(self, out: Mapping[str, Any]) -> None:
        """Take one stream chunk. A cumulative chunk (its list is as long as
        ``output_token_logprobs_length``) is superseded by the next one, so it is only kept by
        reference and parsed when a delta or the final chunk needs it; this keeps the proxy's
        per-chunk work to one JSON round trip in SGLang's default cumulative mode."""
        meta = out.get("meta_info")
        if isinstance(meta, dict) and meta.get("finish_reason") is None:
            total = meta.get("output_token_logprobs_length")
            entries = meta.get("output_token_logprobs")
            if isinstance(total, int) and isinstance(entries, list) and len(entries) == total:
                self.pending = {
                    "meta_info": dict(meta),
                    "prompt_token_ids": out.get("prompt_token_ids"),
                }
                return
        if self.pending is not None:
            pending, self.pending = self.pending, None
            if not _is_whole(out):
                self.feed(pending, stream=True)
        self.feed(out, stream=True)

    def feed(self, out: Mapping[str, Any], *, stream: bool) -> None:
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
            raise WireError(
                f"meta_info.output_top_logprobs: {len(tops)} rows for {len(ids)} tokens"
            )
        if self._is_delta(meta, ids, stream):
            self.ids.extend(ids)
            self.logps.extend(logps)
            if tops is not None:
                self.tops = (self.tops or []) + tops
        else:
            self.ids, self.logps = ids, logps
            if tops is not None:
                self.tops = tops
        prompt = out.get("prompt_token_ids")
        if isinstance(prompt, list):
            self.prompt_ids = [int(t) for t in prompt]

    def _is_delta(self, meta: Mapping[str, Any], ids: list[int], stream: bool) -> bool:
        if not stream or not self.ids:
            return False
        total = meta.get("output_token_logprobs_length")
        if isinstance(total, int):
            if len(ids) == total:
                return False
            if len(self.ids) + len(ids) == total:
                return True
            raise WireError(
                f"meta_info.output_token_logprobs_length: {total} is neither the chunk's "
                f"{len(ids)} tokens nor {len(self.ids)} seen + {len(ids)}"
            )
        # SGLang before output_token_logprobs_length: cumulative chunks repeat the prefix.
        return not (len(ids) >= len(self.ids) and ids[: len(self.ids)] == self.ids)

    def record(
        self,
        meta: Mapping[str, Any],
        *,
        fallback_prompt: list[int] | None,
        vocab_size: int | None,
    ) -> RolloutRecord:
        rid = meta.get("id")
        if not isinstance(rid, str):
            raise WireError(f"meta_info.id: expected a string, got {rid!r}")
        missing = [i for i, lp in enumerate(self.logps) if lp is None]
        if missing:
            raise WireError(f"meta_info.output_token_logprobs[{missing[0]}][0]: logprob is null")
        weight_version = meta.get("weight_version")
        weight_version = None if weight_version is None else str(weight_version)
        lower = tail = source = None
        if self.tops is not None and self.ids and all(row for row in self.tops):
            lower, tail = topk_entropy_bounds([r or [] for r in self.tops], vocab_size=vocab_size)
            source = "topk"
        prompt = self.prompt_ids if self.prompt_ids is not None else fallback_prompt
        return RolloutRecord(
            rid=rid,
            input_ids=prompt,
            output_ids=self.ids,
            logp=self.logps,
            runs=version_runs(meta.get("weight_versions"), len(self.ids), weight_version),
            finish_reason=finish_type(meta.get("finish_reason")),
            weight_version=weight_version,
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
