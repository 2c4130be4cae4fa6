"""vLLM adapter: OpenAI chat / completions answers with logprobs → `RolloutRecord`.

Ask vLLM (≥ 0.10.2) for ``logprobs`` (completions: an int k; chat: ``logprobs: true`` and
``top_logprobs: k``) and ``return_token_ids: true``. Field layout verified against vLLM's
``vllm/entrypoints/openai/completion/protocol.py`` and ``chat_completion/protocol.py``:

* completions: ``choices[i].token_ids`` (output ids), ``choices[i].prompt_token_ids``,
  ``choices[i].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob} | null],
  text_offset}``;
* chat: ``choices[i].token_ids``, top-level ``prompt_token_ids``,
  ``choices[i].logprobs.content = [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]``.

vLLM's OpenAI protocol has no weight-version field; RL stacks that serve versioned weights
(and SGLang's OpenAI endpoints, under ``sglext``) report ``weight_version`` /
``weight_versions`` spans. The adapter reads them from the choice, the response or its
``sglext`` / ``metadata`` block when present, else uses the ``weight_version`` argument.

vLLM's per-position top lists may spend one slot on the sampled token, so the entropy bound
treats only ``len - 1`` entries as the guaranteed top-k (see `proxy.records`). Completions
key ``top_logprobs`` by token *text*: distinct ids with equal text collapse; request
``return_tokens_as_token_ids`` to keep them apart. vLLM returns raw (pre-temperature)
log-probs unless served with ``--logprobs-mode processed_logprobs``; μ must come from the
distribution actually sampled, so set that mode when sampling at temperature ≠ 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..records import RolloutRecord, topk_entropy_bounds
from ..sglang.wire import WireError, versions_from_spans

__all__ = ["records_from_openai", "records_from_completion", "records_from_chat"]


def _ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise WireError(f"{where}: missing or not a list (send return_token_ids: true)")
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool):
            raise WireError(f"{where}[{i}]: token id must be an int, got {t!r}")
    return list(value)


def _logp(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireError(f"{where}: logprob must be a number, got {value!r}")
    return float(value)


def _versions(
    resp: Mapping[str, Any], choice: Mapping[str, Any], n: int, default: str | None
) -> tuple[list[str | None], str | None]:
    for src in (choice, resp, resp.get("sglext") or {}, resp.get("metadata") or {}):
        if not isinstance(src, Mapping):
            continue
        wv = src.get("weight_version")
        if src.get("weight_versions") is not None or wv is not None:
            label = default if wv is None else str(wv)
            return versions_from_spans(src.get("weight_versions"), n, label), label
    return [default] * n, default


def _record(
    resp: Mapping[str, Any],
    choice: Mapping[str, Any],
    *,
    ids: list[int],
    logps: list[float],
    tops: list[list[float]] | None,
    prompt: list[int] | None,
    vocab_size: int | None,
    weight_version: str | None,
) -> RolloutRecord:
    n_choices = len(resp.get("choices") or [])
    rid = str(resp.get("id", ""))
    if n_choices > 1:
        rid = f"{rid}:{choice.get('index', 0)}"
    versions, label = _versions(resp, choice, len(ids), weight_version)
    lower = tail = None
    source = None
    if tops is not None and ids and all(tops):
        bounds = [
            topk_entropy_bounds(row, k=max(len(row) - 1, 1), vocab_size=vocab_size) for row in tops
        ]
        lower = tuple(b.lower for b in bounds)
        tail = tuple(b.tail or 0.0 for b in bounds) if vocab_size is not None else None
        source = "topk"
    return RolloutRecord(
        rid=rid,
        input_ids=None if prompt is None else tuple(prompt),
        output_ids=tuple(ids),
        logp=tuple(logps),
        versions=tuple(versions),
        finish_reason=choice.get("finish_reason"),
        weight_version=label,
        entropy_lower=lower,
        entropy_tail=tail,
        entropy_source=source,
        engine="vllm",
    )


def records_from_completion(
    resp: Mapping[str, Any], *, vocab_size: int | None = None, weight_version: str | None = None
) -> list[RolloutRecord]:
    """Records from a ``/v1/completions`` answer (one per choice)."""
    out = []
    for c, choice in enumerate(resp.get("choices") or []):
        where = f"choices[{c}]"
        ids = _ids(choice.get("token_ids"), f"{where}.token_ids")
        lp = choice.get("logprobs")
        if not isinstance(lp, Mapping):
            raise WireError(f"{where}.logprobs: missing (send logprobs: k)")
        raw = lp.get("token_logprobs")
        if not isinstance(raw, list) or len(raw) != len(ids):
            got = len(raw) if isinstance(raw, list) else raw
            raise WireError(f"{where}.logprobs.token_logprobs: {got} entries for {len(ids)} ids")
        logps = [_logp(v, f"{where}.logprobs.token_logprobs[{t}]") for t, v in enumerate(raw)]
        tops = None
        top_raw = lp.get("top_logprobs")
        if isinstance(top_raw, list) and len(top_raw) == len(ids):
            tops = [
                [_logp(v, f"{where}.logprobs.top_logprobs[{t}]") for v in row.values()]
                if isinstance(row, Mapping)
                else []
                for t, row in enumerate(top_raw)
            ]
        prompt = choice.get("prompt_token_ids")
        out.append(
            _record(
                resp,
                choice,
                ids=ids,
                logps=logps,
                tops=tops,
                prompt=None if prompt is None else _ids(prompt, f"{where}.prompt_token_ids"),
                vocab_size=vocab_size,
                weight_version=weight_version,
            )
        )
    return out


def records_from_chat(
    resp: Mapping[str, Any], *, vocab_size: int | None = None, weight_version: str | None = None
) -> list[RolloutRecord]:
    """Records from a ``/v1/chat/completions`` answer (one per choice)."""
    prompt_raw = resp.get("prompt_token_ids")
    prompt = None if prompt_raw is None else _ids(prompt_raw, "prompt_token_ids")
    out = []
    for c, choice in enumerate(resp.get("choices") or []):
        where = f"choices[{c}]"
        ids = _ids(choice.get("token_ids"), f"{where}.token_ids")
        lp = choice.get("logprobs")
        content = lp.get("content") if isinstance(lp, Mapping) else None
        if not isinstance(content, list) or len(content) != len(ids):
            got = len(content) if isinstance(content, list) else content
            raise WireError(f"{where}.logprobs.content: {got} entries for {len(ids)} token ids")
        logps: list[float] = []
        tops: list[list[float]] | None = []
        for t, entry in enumerate(content):
            if not isinstance(entry, Mapping):
                raise WireError(f"{where}.logprobs.content[{t}]: expected an object")
            logps.append(_logp(entry.get("logprob"), f"{where}.logprobs.content[{t}].logprob"))
            row = entry.get("top_logprobs") or []
            if tops is not None:
                tops.append(
                    [
                        _logp(e.get("logprob"), f"{where}.logprobs.content[{t}].top_logprobs")
                        for e in row
                        if isinstance(e, Mapping)
                    ]
                )
        out.append(
            _record(
                resp,
                choice,
                ids=ids,
                logps=logps,
                tops=tops,
                prompt=prompt,
                vocab_size=vocab_size,
                weight_version=weight_version,
            )
        )
    return out


def records_from_openai(
    resp: Mapping[str, Any], *, vocab_size: int | None = None, weight_version: str | None = None
) -> list[RolloutRecord]:
    """Dispatch on the answer's ``object``: ``text_completion`` or ``chat.completion``."""
    kind = resp.get("object")
    if kind == "text_completion":
        return records_from_completion(resp, vocab_size=vocab_size, weight_version=weight_version)
    if kind == "chat.completion":
        return records_from_chat(resp, vocab_size=vocab_size, weight_version=weight_version)
    raise WireError(f"object: expected 'text_completion' or 'chat.completion', got {kind!r}")
