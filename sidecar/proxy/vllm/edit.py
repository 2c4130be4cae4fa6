"""vLLM's OpenAI-compatible answers read and restored on their bytes.

The proxy asks vLLM for what the sidecar needs (`plan_request`): the sampled token's log-prob
(``logprobs: 0`` on completions and ``/inference/v1/generate``, ``logprobs: true`` on chat) and
the token ids (``return_token_ids: true``). vLLM writes every field of its answer models, so a
field the client did not ask for is present as ``null`` (non-streamed: ``model_dump()``;
streamed: ``model_dump_json(exclude_unset=True)`` with the field passed explicitly). Restoring
an answer therefore replaces the added members' values by ``null`` (`edit_answer`): in place
where the C reader is built (its structural walk gives each member's span, so a string that
happens to contain a key never matches), all other bytes the upstream's; without it the answer
is written again by orjson, the same JSON (`proxy.vllm.tree`).

What is read per choice:

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

from ....monitor.core.errors import NotFast, WireError
from .tree import Node, Tree, ints, tree_of

__all__ = [
    "VllmPlan",
    "ChoicePart",
    "plan_request",
    "edit_answer",
    "SAMPLING_KEYS",
    "CLAMPED_LOGPROB",
]

#: The request keys recorded with each sample (the rest of the sampling parameters do not
#: change which distribution the sampled token came from).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed")
#: vLLM's OpenAI layer writes -inf as this value.
CLAMPED_LOGPROB = -9999.0


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
    sampling: dict[str, Any]  # the `SAMPLING_KEYS` the request set


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


def _set(params: dict[str, Any]) -> dict[str, Any]:
    return {k: params[k] for k in SAMPLING_KEYS if params.get(k) is not None}


def plan_request(kind: str, body: Any) -> VllmPlan | None:
    """The forwarded body for a completions / chat / generate request; None when the proxy
    leaves the request alone (not a JSON object, echo, beam search, a client that asked for
    top-k without log-probs: vLLM's own answer to those is passed through untouched)."""
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
        sampling = _set(params)
        if params.get("logprobs") is None:
            out["sampling_params"] = dict(params, logprobs=0)
            cut_logprobs = True
    else:
        if body.get("echo") or body.get("use_beam_search"):
            return None
        sampling = _set(body)
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


def _floats(values: Any, where: str) -> np.ndarray:
    try:
        out = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise WireError(f"{where}: log-probs must be numbers") from None
    if out.ndim != 1:
        raise WireError(f"{where}: expected a list of numbers")
    out[out <= CLAMPED_LOGPROB] = -np.inf
    return out


def _logps(tree: Tree, lp: Node, kind: str, where: str) -> np.ndarray:
    if kind == "completions":
        got = tree.member(lp, "token_logprobs")
        if got is None:
            raise WireError(f"{where}.token_logprobs: missing")
        return _floats(tree.value(got), f"{where}.token_logprobs")
    content = tree.member(lp, "content")
    if content is None:
        raise WireError(f"{where}.content: missing")
    if tree.is_null(content):
        return np.zeros(0)
    values = tree.column(content, "logprob")
    if values is None:
        raise WireError(f"{where}.content: not a list of {{logprob: number}} objects")
    return _floats(values, f"{where}.content[].logprob")


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
    tree = tree_of(buf, cut=plan.changed)
    root = tree.root
    cuts: list[Node] = []
    top_prompt = tree.member(root, "prompt_token_ids")
    if plan.cut_ids and not tree.is_null(top_prompt):
        cuts.append(top_prompt)
    info: dict[str, Any] = {}
    for key in ("id", "request_id", "weight_version", "weight_versions"):
        if (node := tree.member(root, key)) is not None:
            info[key] = tree.value(node)
    prompt_top = None
    if read and plan.kind == "chat" and not tree.is_null(top_prompt):
        prompt_top = ints(tree, top_prompt, "prompt_token_ids")
        info["prompt_token_ids"] = prompt_top
    choices = tree.member(root, "choices")
    items = None if choices is None else tree.items(choices)
    if items is None:
        raise NotFast("no choices list")
    parts: list[ChoicePart] = []
    for c, ch in enumerate(items):
        ids_node, lp = tree.member(ch, "token_ids"), tree.member(ch, "logprobs")
        ch_prompt = tree.member(ch, "prompt_token_ids")
        for node, cut in (
            (lp, plan.cut_logprobs),
            (ids_node, plan.cut_ids),
            (ch_prompt, plan.cut_ids),
        ):
            if cut and not tree.is_null(node):
                cuts.append(node)
        finish = tree.value(tree.member(ch, "finish_reason"))
        delta = tree.member(ch, "delta")
        bare = bool(
            plan.cut_logprobs
            and plan.cut_ids
            and finish is None
            and delta is not None
            and tree.value(delta) == {}
        )
        no_ids, no_lp = tree.is_null(ids_node), tree.is_null(lp)
        if not read or (no_ids and no_lp and plan.stream and finish is None):
            if bare:
                parts.append(ChoicePart(0, np.zeros(0, np.int64), np.zeros(0), None, bare=True))
            continue  # not read, or a stream's role-only or empty chunk
        where = f"choices[{c}]"
        if no_ids:
            raise WireError(f"{where}.token_ids: missing (send return_token_ids: true)")
        ids = ints(tree, ids_node, f"{where}.token_ids")
        if lp is None:
            raise WireError(f"{where}.logprobs: missing")
        if no_lp:
            if ids.size:
                raise WireError(f"{where}.logprobs: missing (log-probs not returned)")
            logps = np.zeros(0)
        else:
            logps = _logps(tree, lp, plan.kind, f"{where}.logprobs")
        if logps.shape != ids.shape:
            raise WireError(f"{where}.logprobs: {logps.size} log-probs for {ids.size} token ids")
        prompt = prompt_top
        if plan.kind == "completions" and not tree.is_null(ch_prompt):
            prompt = ints(tree, ch_prompt, f"{where}.prompt_token_ids")
        index = tree.value(tree.member(ch, "index"))
        parts.append(
            ChoicePart(
                index=index if isinstance(index, int) else c,
                ids=ids,
                logps=logps,
                finish_reason=None if finish is None else str(finish),
                prompt=prompt,
                spans=tree.value(tree.member(ch, "weight_versions")),
                version=_version(tree.value(tree.member(ch, "weight_version"))),
                bare=bare,
            )
        )
    return (tree.cut(cuts) if cuts else buf), parts, info


def _version(value: Any) -> str | None:
    return None if value is None else str(value)


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
