"""vLLM OpenAI answers → RolloutRecord.

The answers are built in vLLM's response layout (``vllm/entrypoints/openai/completion/
protocol.py`` CompletionResponse / ``chat_completion/protocol.py`` ChatCompletionResponse with
``return_token_ids``) from an explicit distribution, so μ and the entropy bounds are checked
against float64 values computed here.
"""

from __future__ import annotations

import math

import pytest

from timwatch.sidecar.proxy.records import topk_entropy_bounds
from timwatch.sidecar.proxy.sglang.wire import WireError
from timwatch.sidecar.proxy.vllm.wire import (
    records_from_chat,
    records_from_completion,
    records_from_openai,
)

VOCAB = 6
# two positions, each a full distribution over 6 tokens
DISTS = [
    [0.5, 0.2, 0.1, 0.1, 0.05, 0.05],
    [0.05, 0.05, 0.6, 0.2, 0.05, 0.05],
]
SAMPLED = [1, 2]
PROMPT = [11, 12, 13]


def _top_sorted(dist: list[float], k: int) -> list[tuple[int, float]]:
    order = sorted(range(len(dist)), key=lambda t: -dist[t])[:k]
    return [(t, math.log(dist[t])) for t in order]


def completion_answer(k: int = 2) -> dict:
    tops = []
    for dist, tok in zip(DISTS, SAMPLED, strict=True):
        # vLLM puts the sampled token in the dict beside the top-k
        row = {f"token_id:{t}": lp for t, lp in _top_sorted(dist, k)}
        row[f"token_id:{tok}"] = math.log(dist[tok])
        tops.append(row)
    return {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "xy",
                "logprobs": {
                    "text_offset": [0, 1],
                    "token_logprobs": [math.log(d[t]) for d, t in zip(DISTS, SAMPLED, strict=True)],
                    "tokens": [f"token_id:{t}" for t in SAMPLED],
                    "top_logprobs": tops,
                },
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": SAMPLED,
                "prompt_logprobs": None,
                "prompt_token_ids": PROMPT,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def chat_answer(k: int = 3, n: int = 1) -> dict:
    def content() -> list[dict]:
        out = []
        for dist, tok in zip(DISTS, SAMPLED, strict=True):
            top = [
                {"token": f"t{t}", "logprob": lp, "bytes": [116]} for t, lp in _top_sorted(dist, k)
            ]
            out.append(
                {
                    "token": f"t{tok}",
                    "logprob": math.log(dist[tok]),
                    "bytes": [116],
                    "top_logprobs": top,
                }
            )
        return out

    return {
        "id": "chatcmpl-xyz",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": "xy"},
                "logprobs": {"content": content()},
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": SAMPLED,
            }
            for i in range(n)
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "prompt_logprobs": None,
        "prompt_token_ids": PROMPT,
    }


def test_completion_answer_to_record() -> None:
    [rec] = records_from_completion(completion_answer(), vocab_size=VOCAB, weight_version="7")
    assert rec.rid == "cmpl-abc" and rec.engine == "vllm"
    assert rec.input_ids == tuple(PROMPT) and rec.output_ids == tuple(SAMPLED)
    assert rec.logp == pytest.approx([math.log(0.2), math.log(0.6)], abs=1e-15)
    assert rec.versions == ("7", "7") and rec.finish_reason == "length"
    # position 0: dict = top-2 {0, 1} (sampled 1 is among them) -> 2 entries, only 1 trusted
    p = [0.5, 0.2]
    head = -sum(x * math.log(x) for x in p)
    assert rec.entropy_lower[0] == pytest.approx(head + 0.3 * -math.log(0.5))
    assert rec.entropy_tail[0] == pytest.approx(0.3 * math.log(4 / 0.3))
    for t, dist in enumerate(DISTS):
        exact = -sum(x * math.log(x) for x in dist)
        assert rec.entropy_lower[t] <= exact
        assert rec.entropy_source == "topk"


def test_sampled_token_outside_topk_keeps_the_bound_sound() -> None:
    # sampled token 5 (p=0.05) is outside the top-2; the dict holds 3 entries
    dist = DISTS[0]
    row = [math.log(0.5), math.log(0.2), math.log(0.05)]
    b = topk_entropy_bounds(row, k=len(row) - 1, vocab_size=VOCAB)
    exact = -sum(x * math.log(x) for x in dist)
    assert b.lower <= exact <= b.upper
    # trusting all three entries as the top-3 would overshoot here
    naive = topk_entropy_bounds(row, vocab_size=VOCAB)
    assert naive.lower > exact


def test_chat_answer_to_record_with_versions_and_choices() -> None:
    ans = chat_answer(n=2)
    ans["sglext"] = {
        "weight_version": "v2",
        "weight_versions": [
            {"version": "v1", "start": 0, "end": 1},
            {"version": "v2", "start": 1, "end": 2},
        ],
    }
    recs = records_from_openai(ans, vocab_size=VOCAB)
    assert [r.rid for r in recs] == ["chatcmpl-xyz:0", "chatcmpl-xyz:1"]
    for rec in recs:
        assert rec.input_ids == tuple(PROMPT) and rec.versions == ("v1", "v2")
        assert rec.weight_version == "v2" and rec.finish_reason == "stop"
        top = [0.6, 0.2, 0.05]  # position 1, top-3, two trusted
        head = -sum(x * math.log(x) for x in top)
        assert rec.entropy_lower[1] == pytest.approx(head + 0.15 * -math.log(0.2))


def test_missing_token_ids_is_a_clear_error() -> None:
    ans = chat_answer()
    del ans["choices"][0]["token_ids"]
    with pytest.raises(WireError, match=r"choices\[0\]\.token_ids.*return_token_ids"):
        records_from_chat(ans)
    comp = completion_answer()
    comp["choices"][0]["logprobs"]["token_logprobs"][1] = "bad"
    with pytest.raises(WireError, match=r"choices\[0\]\.logprobs\.token_logprobs\[1\]"):
        records_from_completion(comp)
    with pytest.raises(WireError, match="object"):
        records_from_openai({"object": "embedding"})
