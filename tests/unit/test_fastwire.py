"""The byte path (`proxy.sglang.fastwire`, where the C reader is built) against the object path
(`proxy.sglang.wire`, the orjson fallback).

Answers and stream chunks come from the SGLang stand-in (`tests/helpers/fake_sglang.py`, in
process; real SGLang needs a GPU), written both as the stand-in writes them and as SGLang's
orjson does. For every request shape the byte path must give the client the bytes the object
path gives, and capture the same record; where it cannot, it must refuse (`NotFast`), never
guess.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

import tests.helpers.fake_sglang as fake
from tests.helpers.readers import require_c
from timwatch.sidecar.proxy.records import RolloutRecord
from timwatch.sidecar.proxy.sglang.fastwire import (
    NotFast,
    cumulative,
    finished,
    int_value,
    read_bytes,
    restore,
    small_meta,
)
from timwatch.sidecar.proxy.sglang.wire import SampleState, dumps, plan_request

TOPK = 5


@pytest.fixture(scope="module", autouse=True)
def _c_built() -> None:
    require_c()


CLIENTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"return_logprob": True},
    "logprobs-top2": {"return_logprob": True, "top_logprobs_num": 2},
    "logprobs-top7": {"return_logprob": True, "top_logprobs_num": 7},
    "prompt-ids": {"return_logprob": True, "return_prompt_token_ids": True},
}


def _answers(req: dict[str, Any], incremental: bool, switch: bool) -> list[dict[str, Any]]:
    """Every chunk the stand-in sends for ``req`` (one object if not streamed)."""
    f = fake.Fake(incremental)
    if switch:
        f.config = {"switch_at": 3, "next_version": "step-2"}
    samples, items, _ = fake._build(f, req)
    (s,) = samples
    if not req.get("stream"):
        while s.finish is None:
            s.step()
        return [s.answer(req, items[0], 0)]
    out, lo = [], 0
    while s.finish is None:
        s.step()
        out.append(s.answer(req, items[0], lo))
        lo = len(s.ids)
    return out


def _same(a: RolloutRecord, b: RolloutRecord) -> None:
    da, db = a.to_dict(), b.to_dict()
    for key in ("entropy_lower", "entropy_tail"):
        x, y = da.pop(key), db.pop(key)
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)
    da.pop("created"), db.pop("created")
    assert da == db
    assert (a.input_ids is None or a.input_ids.dtype) == (b.input_ids is None or b.input_ids.dtype)
    assert a.output_ids.dtype == b.output_ids.dtype


@pytest.mark.parametrize("client", sorted(CLIENTS))
@pytest.mark.parametrize("mode", ["answer", "cumulative", "incremental"])
@pytest.mark.parametrize("writer", ["orjson", "stand-in"])
@pytest.mark.parametrize("switch", [False, True])
def test_byte_path_equals_object_path(client: str, mode: str, writer: str, switch: bool) -> None:
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": 9}, **CLIENTS[client]}
    body["stream"] = mode != "answer"
    plan = plan_request(body, TOPK)
    assert plan is not None
    write = orjson.dumps if writer == "orjson" else fake._dumps
    chunks = [write(c) for c in _answers(plan.body, mode == "incremental", switch)]
    fast, slow = SampleState(), SampleState()
    for raw in chunks:
        obj = orjson.loads(raw)
        last = obj["meta_info"]["finish_reason"] is not None
        assert finished(raw) == last
        if mode == "answer":
            fast.add(read_bytes(raw)[0], stream=False)
            slow.feed(obj, stream=False)
        else:
            total = int_value(raw, b"output_token_logprobs_length")
            assert total is not None
            if not last and cumulative(raw, total, total - fast.total):
                fast.hold(lambda raw=raw: read_bytes(raw)[0], total)
            else:
                fast.add(read_bytes(raw)[0])
            slow.offer(obj)
        plan.restore(obj, 0)
        restored = restore(raw, plan, 0)
        if writer == "orjson":
            assert restored == dumps(obj)
        else:
            assert orjson.loads(restored) == obj
    meta = orjson.loads(chunks[-1])["meta_info"]
    want = slow.record(meta, fallback_prompt=None, vocab_size=fake.VOCAB)
    got = fast.record(
        small_meta(chunks[-1], read_bytes(chunks[-1])[1]),
        fallback_prompt=None,
        vocab_size=fake.VOCAB,
    )
    _same(got, want)
    assert got.nbytes == want.nbytes


def test_unchanged_request_keeps_the_bytes() -> None:
    body = {"input_ids": [1, 2, 3], "return_logprob": True, "top_logprobs_num": TOPK}
    plan = plan_request(body, TOPK)
    assert plan is not None and not plan.changed
    (ans,) = _answers(plan.body, False, False)
    raw = orjson.dumps(ans)
    assert restore(raw, plan, 0) is raw


@pytest.mark.parametrize(
    "meta",
    [
        # token text in the log-probs: strings inside the triples
        {"output_token_logprobs": [[-0.5, 3, 'a,"b'], [-0.25, 4, "]]"]]},
        # a null log-prob
        {"output_token_logprobs": [[-0.5, 3, None], [None, 4, None]]},
        # a null top-k row
        {
            "output_token_logprobs": [[-0.5, 3, None], [-0.7, 4, None]],
            "output_top_logprobs": [[[-0.5, 3, None]], None],
        },
    ],
)
def test_refuses_what_it_cannot_read_exactly(meta: dict[str, Any]) -> None:
    meta = {"id": "r", "finish_reason": {"type": "length", "length": 2}, **meta}
    meta["output_token_logprobs_length"] = 2
    raw = orjson.dumps({"text": "ab", "output_ids": [3, 4], "meta_info": meta})
    with pytest.raises(NotFast):
        read_bytes(raw)


def test_record_costs_under_40_bytes_per_token() -> None:
    n = 4096
    rng = np.random.default_rng(0)
    rec = RolloutRecord(
        rid="r" * 36,
        input_ids=rng.integers(0, 150_000, 512),
        output_ids=rng.integers(0, 150_000, n),
        logp=-rng.random(n),
        runs=(("step-1", n),),
        finish_reason="length",
        weight_version="step-1",
        entropy_lower=rng.random(n),
        entropy_tail=rng.random(n),
        entropy_source="topk",
    )
    assert rec.nbytes / n <= 40
    assert rec.output_ids.dtype == np.int32 and rec.versions == ("step-1",) * n
    assert RolloutRecord.from_dict(rec.to_dict()) == rec
