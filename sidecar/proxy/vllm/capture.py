"""Capturing vLLM answers and streams while relaying them (`proxy.vllm.edit` does the bytes).

A non-streamed answer is edited and read in one structural walk; a stream is cut into
``data: ...\\n\\n`` frames as bytes arrive (`proxy.http.sse.relay_frames`), each frame edited on
its own, and every frame complete in one read goes out in one write. A choice's tokens are
gathered over its chunks and committed when a chunk carries its ``finish_reason``.

Each record carries the request's sampling parameters and the engine's log-prob mode. When the
engine returns raw log-probs (vLLM's default) for a request that samples from another
distribution (`vllm_edit.truncates`), μ is not the sampling distribution: that sample is counted
as a *sampling-side mismatch* (``sampling_mismatch_samples`` / ``_tokens``), apart from engine
noise, and logged once per distinct parameter set.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from ....monitor.core.errors import NotFast, WireError
from ..http.sse import relay_frames
from ..records import RolloutRecord, version_runs
from .edit import (
    ChoicePart,
    VllmPlan,
    edit_answer,
    truncates,
)

__all__ = ["VllmCapturer", "answer_parts", "relay_stream", "COUNTER_NAMES"]

log = logging.getLogger(__name__)

COUNTER_NAMES = (
    "requests",
    "uncaptured_requests",
    "wire_errors",
    "upstream_errors",
    "sampling_mismatch_samples",
    "sampling_mismatch_tokens",
    "impossible_tokens",
)


class VllmCapturer:
    """Where finished samples go, with the engine's log-prob mode and the proxy's counters."""

    def __init__(
        self, commit: Callable[[RolloutRecord], None], counters: dict[str, int], logprobs_mode: str
    ) -> None:
        self.commit = commit
        self.counters = counters
        self.logprobs_mode = logprobs_mode
        self._warned: set[tuple[tuple[str, Any], ...]] = set()

    def wire_error(self, what: str, exc: Exception) -> None:
        self.counters["wire_errors"] += 1
        log.warning("%s not captured: %s", what, exc)

    def finish(
        self,
        plan: VllmPlan,
        rid: str,
        part: ChoicePart,
        ids: np.ndarray,
        logps: np.ndarray,
        prompt: np.ndarray | None,
        spans: Any,
        version: str | None,
    ) -> None:
        sampling = plan.sampling
        n = len(ids)
        record = RolloutRecord(
            rid=rid,
            input_ids=prompt,
            output_ids=ids,
            logp=logps,
            runs=version_runs(spans, n, version),
            finish_reason=part.finish_reason,
            weight_version=version,
            engine="vllm",
            sampling=sampling,
            logprobs_mode=self.logprobs_mode,
        )
        impossible = int(np.count_nonzero(np.isneginf(logps)))
        self.counters["impossible_tokens"] += impossible
        if self.logprobs_mode == "raw_logprobs" and truncates(sampling):
            self.counters["sampling_mismatch_samples"] += 1
            self.counters["sampling_mismatch_tokens"] += n
            key = tuple(sorted(sampling.items()))
            if key not in self._warned and len(self._warned) < 64:
                self._warned.add(key)
                log.warning(
                    "sampling-side mismatch: the engine returns raw log-probs but the request "
                    "samples with %s; μ is not the sampling distribution (serve vLLM with "
                    "--logprobs-mode processed_logprobs)",
                    sampling,
                )
        self.commit(record)


def _rid(info: dict[str, Any], part: ChoicePart, choices: int) -> str:
    rid = info.get("id", info.get("request_id"))
    rid = "" if rid is None else str(rid)
    return f"{rid}:{part.index}" if choices > 1 else rid


def _version(info: dict[str, Any], part: ChoicePart) -> tuple[Any, str | None]:
    if part.spans is not None or part.version is not None:
        return part.spans, part.version
    wv = info.get("weight_version")
    return info.get("weight_versions"), None if wv is None else str(wv)


def _prompt(plan: VllmPlan, part: ChoicePart) -> np.ndarray | None:
    if part.prompt is not None:
        return part.prompt
    return None if plan.prompt_ids is None else np.array(plan.prompt_ids, dtype=np.int64)


def _many(plan: VllmPlan) -> bool:
    body = plan.body
    n = body.get("n") or (body.get("sampling_params") or {}).get("n") or 1
    prompt = body.get("prompt")
    many_prompts = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return bool(n != 1 or many_prompts)


def answer_parts(
    cap: VllmCapturer, plan: VllmPlan, content: bytes
) -> tuple[bytes, Callable[[], None] | None]:
    """The client's bytes of a non-streamed answer and the capture to run once they are sent."""
    try:
        client, parts, info = edit_answer(content, plan)
    except (NotFast, WireError) as exc:
        cap.wire_error("answer", exc)
        try:
            client = edit_answer(content, plan, read=False)[0]
        except (NotFast, WireError):
            client = content
        return client, None

    def capture() -> None:
        # the one frame of a stream (every choice of a finished answer has its finish_reason)
        stream = _Stream(cap, plan)
        stream.many |= len(parts) > 1
        for part in parts:
            stream.take(part, info)

    return client, capture


class _Choice:
    __slots__ = ("ids", "logps", "prompt", "spans", "version")

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.logps: list[np.ndarray] = []
        self.prompt: np.ndarray | None = None
        self.spans: Any = None
        self.version: str | None = None


class _Stream:
    def __init__(self, cap: VllmCapturer, plan: VllmPlan) -> None:
        self.cap, self.plan = cap, plan
        self.choices: dict[int, _Choice] = {}
        self.broken: set[int] = set()
        self.many = _many(plan)
        self.prompt: np.ndarray | None = None

    def frame(self, frame: bytes) -> bytes:
        if not frame.startswith(b"data: {"):
            return frame
        payload = frame[6:-2]
        try:
            client, parts, info = edit_answer(payload, self.plan)
        except NotFast:
            return frame  # an error object or a usage-only chunk: nothing was added to it
        except WireError as exc:
            self.cap.wire_error("stream chunk", exc)
            try:
                client = edit_answer(payload, self.plan, read=False)[0]
            except (NotFast, WireError):
                return frame
            return frame if client is payload else b"data: " + client + b"\n\n"
        if info.get("prompt_token_ids") is not None:
            self.prompt = info["prompt_token_ids"]
        for part in parts:
            try:
                self.take(part, info)
            except Exception:  # a capture bug must not cut the client's stream off
                log.exception("stream choice %s: capture failed, not captured", part.index)
                self.broken.add(part.index)
                self.choices.pop(part.index, None)
                self.cap.counters["wire_errors"] += 1
        if parts and all(p.bare for p in parts) and self.plan.kind == "chat":
            return b""
        return frame if client is payload else b"data: " + client + b"\n\n"

    def take(self, part: ChoicePart, info: dict[str, Any]) -> None:
        if part.index in self.broken or (part.bare and not part.ids.size):
            return
        ch = self.choices.get(part.index)
        if ch is None:
            ch = self.choices[part.index] = _Choice()
        if part.ids.size:
            ch.ids.append(part.ids)
            ch.logps.append(part.logps)
        if part.prompt is not None:
            ch.prompt = part.prompt
        spans, version = _version(info, part)
        if spans is not None or version is not None:
            ch.spans, ch.version = spans, version
        if part.finish_reason is None:
            return
        del self.choices[part.index]
        ids = np.concatenate(ch.ids) if ch.ids else np.zeros(0, np.int64)
        logps = np.concatenate(ch.logps) if ch.logps else np.zeros(0)
        prompt = ch.prompt if ch.prompt is not None else self.prompt
        if prompt is None:
            prompt = _prompt(self.plan, part)
        try:
            self.cap.finish(
                self.plan,
                _rid(info, part, 2 if self.many else 1),
                part,
                ids,
                logps,
                prompt,
                ch.spans,
                ch.version,
            )
        except (WireError, ValueError) as exc:
            self.broken.add(part.index)
            self.cap.wire_error(f"choice {part.index}", exc)


def relay_stream(
    cap: VllmCapturer, plan: VllmPlan, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """Relay vLLM's SSE stream frame by frame, edited and captured; every frame complete in
    one read goes out in one write, a partial frame waits for its end."""
    return relay_frames(_Stream(cap, plan).frame, chunks)
