"""Capturing non-streamed ``/generate`` answers: the client's bytes first, the capture after.

Where the C reader is built (`native`), an answer is first read on its bytes
(`proxy.sglang.fastwire`); whatever that path refuses (batch answers, token text in the
log-probs, a number it does not convert exactly, SGLang before 0.5.3) takes the object path
(`proxy.sglang.wire`, orjson on the whole answer), the only path without the C reader. Both
give the client the same bytes and the same records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..native import cstream
from ..records import RolloutRecord
from .fastwire import NotFast, finished, read_bytes, restore, small_meta
from .wire import (
    RequestPlan,
    SampleState,
    WireError,
    dumps,
    is_finished,
    loads,
    outputs_of,
)

__all__ = ["Capturer", "answer_parts"]

log = logging.getLogger(__name__)


class Capturer:
    """Where finished samples go: the proxy's commit, its counters and the vocabulary size."""

    def __init__(
        self,
        commit: Callable[[RolloutRecord], None],
        counters: dict[str, int],
        vocab_size: int | None,
    ) -> None:
        self.commit = commit
        self.counters = counters
        self.vocab_size = vocab_size

    def wire_error(self, what: str, exc: Exception) -> None:
        self.counters["wire_errors"] += 1
        log.warning("%s not captured: %s", what, exc)

    def finish(
        self, sample: SampleState, meta: Mapping[str, Any], plan: RequestPlan, idx: int
    ) -> None:
        """Commit a finished sample; ``meta`` is its last chunk's ``meta_info`` (the prompt
        ids the client sent stand in for those the answer lacks)."""
        prompts = plan.client_input_ids
        prompt = prompts[plan.prompt_index(idx)] if prompts else None
        self.commit(sample.record(meta, fallback_prompt=prompt, vocab_size=self.vocab_size))


def answer_parts(
    cap: Capturer, plan: RequestPlan, content: bytes
) -> tuple[bytes, Callable[[], None] | None]:
    """The client's bytes of a non-streamed answer, and the capture still to run (None if it
    already ran): the proxy sends the bytes first, so capturing adds nothing to the latency."""
    if cstream() is None or not content.startswith(b"{"):
        return _answer_objects(cap, plan, content), None
    try:
        client = restore(content, plan, 0) if plan.changed else content
        last = finished(content)
    except NotFast:
        return _answer_objects(cap, plan, content), None
    if not last:
        return client, None

    def capture() -> None:
        sample = SampleState()
        try:
            chunk, hole = read_bytes(content)
            meta = small_meta(content, hole)
            sample.add(chunk, stream=False)  # neither raises NotFast
            cap.finish(sample, meta, plan, 0)
        except NotFast:
            _answer_objects(cap, plan, content)
        except (WireError, ValueError) as exc:
            cap.wire_error("answer 0", exc)

    return client, capture


def _answer_objects(cap: Capturer, plan: RequestPlan, content: bytes) -> bytes:
    try:
        answer = loads(content)
        outputs = outputs_of(answer)
    except ValueError as exc:
        cap.counters["wire_errors"] += 1
        log.warning("unparseable /generate answer passed through: %s", exc)
        return content
    for idx, out in enumerate(outputs):
        if not isinstance(out, dict):
            continue
        try:
            if is_finished(out):
                sample = SampleState()
                sample.feed(out, stream=False)
                cap.finish(sample, out["meta_info"], plan, idx)
        except (WireError, ValueError) as exc:
            cap.wire_error(f"answer {idx}", exc)
        plan.restore(out, idx)
    return dumps(answer) if plan.changed else content
