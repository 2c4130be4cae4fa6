"""An incremental stream captured from its reads (`proxy.sglang.stream.StreamReads`) gives the
records the object path gives (orjson on every frame, `SampleState`), wherever the reads are
cut, on the C reader (its delta scan, then the byte path for the frames it leaves) and on the
orjson fallback alike. The C scan's own answers are checked in test_cstream.py.

Streams are built here in SGLang's compact format (one ``data: {...}\\n\\n`` frame per token,
``output_token_logprobs_length`` since 0.5.3), with token texts that start like the keys the
scan looks for, a long text followed by short ones (a frame much shorter than the one before),
log-probs in every shape JSON allows, and token ids of every length.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest

from tests.helpers.readers import stream_reader  # noqa: F401
from tests.helpers.sglang_relay import relayed
from timwatch.sidecar.proxy.records import RolloutRecord
from timwatch.sidecar.proxy.sglang import stream as relay
from timwatch.sidecar.proxy.sglang.answers import Capturer
from timwatch.sidecar.proxy.sglang.wire import SampleState, plan_request

# every test on the C reader and on the orjson fallback
pytestmark = pytest.mark.usefixtures("stream_reader")

_TEXTS = ["n", " the", "fi", "index", "output_top", 'q"uote', "\n", "é", "x" * 100, "a", "b"]
_LOGPS = ["-0.001", "-12.5", "0.0", "-0.0", "-1e-05", "-3.0000000000000004", "-7", "-0.5E+1"]


def _frame(i: int, n: int, text: str, lp: str, tid: int, *, index: int | None = None) -> bytes:
    meta = (
        b'{"id":"abc","finish_reason":%s,"prompt_tokens":3,"weight_version":"default",'
        b'"input_token_logprobs":[],"output_token_logprobs":[[%s,%d,null]],'
        b'"output_token_logprobs_length":%d,"completion_tokens":%d,'
        b'"weight_versions":[{"version":"default","start":0,"end":%d}]}'
    ) % (
        b'{"type":"length","length":%d}' % n if i == n else b"null",
        lp.encode(),
        tid,
        i,
        i,
        i,
    )
    head = b'{"text":%s,"output_ids":[%d],"meta_info":' % (orjson.dumps(text), tid)
    tail = b"}" if index is None else b',"index":%d}' % index
    return b"data: " + head + meta + tail + b"\n\n"


def _stream(n: int, shift: int = 0) -> bytes:
    frames = [
        _frame(
            i,
            n,
            _TEXTS[(i + shift) % len(_TEXTS)],
            _LOGPS[(i * 3 + shift) % len(_LOGPS)],
            (7 * i + shift) * 10 ** (i % 6),
        )
        for i in range(1, n + 1)
    ]
    return b"".join(frames) + b"data: [DONE]\n\n"


def _object_records(raw: bytes) -> list[Any]:
    """The records the object path gives (orjson on every frame), in commit order."""
    states: dict[int, SampleState] = {}
    out: list[Any] = []
    for frame in raw.split(b"\n\n"):
        if frame.startswith(b"data: {"):
            obj = orjson.loads(frame[6:])
            idx = obj.get("index", 0)
            state = states.setdefault(idx, SampleState())
            state.offer(obj)
            if obj["meta_info"]["finish_reason"] is not None:
                out.append(state.record(obj["meta_info"], fallback_prompt=None, vocab_size=None))
                del states[idx]
    return out


def _captured(reads: list[bytes]) -> tuple[list[Any], int]:
    """The records `relay.stream_capture` commits for a stream fed as ``reads``, in commit
    order, and its wire errors."""
    plan = plan_request({"input_ids": [1, 2, 3], "return_logprob": True, "stream": True}, None)
    assert plan is not None
    got: list[RolloutRecord] = []
    counters = {"requests": 0, "wire_errors": 0, "upstream_errors": 0}
    feed = relay.stream_capture(Capturer(got.append, counters, None), plan)
    for part in reads:
        if part:
            feed(part)
    feed.close()
    return got, counters["wire_errors"]


def _bits(values: Any) -> list[int]:
    return np.asarray(values, dtype=np.float64).view(np.int64).tolist()


def _same_records(got: list[Any], want: list[Any]) -> None:
    """The same records, ids and log-prob bits (-0.0 and 0.0 differ), in commit order."""
    assert [(r.output_ids.tolist(), _bits(r.logp)) for r in got] == [
        (r.output_ids.tolist(), _bits(r.logp)) for r in want
    ]


@pytest.mark.parametrize(
    "raw",
    [
        b"".join(_frame(i, 9, "a", "-0.5", i, index=0) for i in range(1, 10)),  # a batch's chunks
        b"".join(_frame(i, 3, "a", "-0.5", i, index=k) for i in range(1, 4) for k in (0, 1)),
        _stream(6).replace(b'"input_token_logprobs":[]', b'"output_top_logprobs":[[]]', 1),
        _stream(6).replace(b'"finish_reason":null', b'"finish_reason":null,"finish_reason":null'),
        _stream(6).replace(b'"text":"', b'"text":"\\n\\"fi', 2),
        _stream(6)[:-14] + b"\n\n" + _stream(3),
        _frame(1, 5, "x" * 900, "-1", 3) + b"".join(_frame(i, 5, "", "-2", 9) for i in range(2, 6)),
        _stream(8).replace(b"[[-12.5,", b"[[-5e-324,", 1),  # a subnormal: the C parse refuses it
        _stream(8).replace(b"[[-7,", b"[[-0.12345678901234567890123,", 1),  # > 19 digits
    ],
    ids=[
        "index", "two-samples", "top-k", "key-twice", "escaped-key-start", "empty-frame",
        "end-skipped", "subnormal-mid-stream", "long-mantissa-mid-stream",
    ],
)  # fmt: skip
def test_frames_the_delta_scan_must_not_take_give_the_object_paths_records(raw: bytes) -> None:
    """Frames the C scan declines or stops at (another sample's, top-k rows, a key twice, a
    string starting like a key, a frame end skipped over, a number it does not convert exactly)
    are read by the byte path or the object path: the records are the object path's, read in
    one piece and cut at every 97th byte."""
    want = _object_records(raw)
    assert want
    for reads in ([raw], [raw[at : at + 97] for at in range(0, len(raw), 97)]):
        got, errors = _captured(reads)
        assert errors == 0
        _same_records(got, want)


def test_stream_capture_at_every_two_read_cut_equals_the_object_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`relay.stream_capture` (what the raw relay feeds) with the stream cut into two reads at
    every byte, each read as it comes: the record is the object path's."""
    monkeypatch.setattr(relay, "BATCH_BYTES", 1)
    raw = _stream(14, shift=3)
    want = _object_records(raw)
    for cut in range(len(raw) + 1):
        got, errors = _captured([raw[:cut], raw[cut:]])
        assert errors == 0, cut
        _same_records(got, want)


def test_a_capture_that_fails_is_counted_and_stops_without_raising(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in the capture must not break the client's stream: `StreamReads` counts it as a
    wire error, logs it, and captures nothing more of that stream (the next one is captured).
    Each read is read as it comes here (`relay.BATCH_BYTES` 1)."""
    monkeypatch.setattr(relay, "BATCH_BYTES", 1)
    raw = _stream(14, shift=3)
    plan = plan_request({"input_ids": [1, 2, 3], "return_logprob": True, "stream": True}, None)
    assert plan is not None
    got: list[RolloutRecord] = []
    counters = {"requests": 0, "wire_errors": 0, "upstream_errors": 0}
    cap = Capturer(got.append, counters, None)
    calls = []
    real = relay._read_small

    def broken(*args: Any) -> int:
        calls.append(1)
        raise RuntimeError("a capture bug")

    monkeypatch.setattr(relay, "_read_small", broken)
    feed = relay.stream_capture(cap, plan)
    half = len(raw) // 2
    feed(raw[:half])  # does not raise
    feed(raw[half:])
    feed.close()
    assert counters["wire_errors"] == 1 and len(calls) == 1  # not tried again
    assert got == []
    monkeypatch.setattr(relay, "_read_small", real)
    feed = relay.stream_capture(cap, plan)
    feed(raw[:half])
    feed(raw[half:])
    feed.close()
    assert counters["wire_errors"] == 1 and len(got) == 1


@pytest.mark.parametrize("batch", [1, 700, relay.BATCH_BYTES], ids=["each", "700", "default"])
def test_a_stream_fed_one_frame_per_read_equals_the_object_path(
    batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How an engine decoding is read: one frame per read. With reads kept until 700 bytes
    (batches end inside frames) or the default, the record is the object path's, committed by
    `close` at the latest; a second `close` changes nothing."""
    monkeypatch.setattr(relay, "BATCH_BYTES", batch)
    raw = _stream(60, shift=5)
    plan = plan_request({"input_ids": [1, 2, 3], "return_logprob": True, "stream": True}, None)
    assert plan is not None
    (want,) = _object_records(raw)
    got: list[RolloutRecord] = []
    counters = {"requests": 0, "wire_errors": 0, "upstream_errors": 0}
    feed = relay.stream_capture(Capturer(got.append, counters, None), plan)
    frames = [f + b"\n\n" for f in raw.split(b"\n\n") if f]
    assert b"".join(frames) == raw
    for frame in frames:
        feed(frame)
    if batch > len(raw):
        assert got == []  # the default batch: all 60 frames kept
    feed.close()
    feed.close()
    assert counters["wire_errors"] == 0
    (rec,) = got
    assert rec.output_ids.tolist() == want.output_ids.tolist()
    assert np.array_equal(np.asarray(rec.logp).view(np.int64), np.asarray(want.logp).view(np.int64))


@pytest.mark.parametrize("bad", [1, 5, 12], ids=["first", "middle", "last"])
@pytest.mark.parametrize("total", [0, 2, 99])
def test_a_chunk_whose_total_disagrees_refuses_its_sample_once(bad: int, total: int) -> None:
    """A chunk of one token whose ``output_token_logprobs_length`` is neither the tokens held + 1
    nor 1 (for the first chunk both readings say 1): the sample is one wire error, no record,
    and its later chunks are not read into a record of the tokens after it. Found by
    hypothesis: a first chunk's total of 0 was taken as whole on the fallback, and on the C
    reader the next chunk was held as a cumulative one of 2 tokens."""
    good = [_frame(i, 12, "a", "-0.5", i) for i in range(1, 13)]
    frames = list(good)
    frames[bad - 1] = frames[bad - 1].replace(
        b'"output_token_logprobs_length":%d,' % bad, b'"output_token_logprobs_length":%d,' % total
    )
    got, errors = _captured([b"".join(frames)])
    assert (errors, got) == (1, [])
    got, errors = _captured([b"".join(good)])
    assert errors == 0 and got[0].output_ids.tolist() == list(range(1, 13))


def test_relay_stream_through_the_fast_path_keeps_bytes() -> None:
    raw = _stream(20)
    plan = plan_request({"input_ids": [1], "return_logprob": True, "stream": True}, None)
    assert plan is not None

    async def run() -> bytes:
        async def chunks() -> AsyncIterator[bytes]:
            for at in range(0, len(raw), 997):
                yield raw[at : at + 997]

        cap = Capturer(lambda r: None, {"wire_errors": 0}, None)
        return await relayed(cap, plan, chunks())

    assert asyncio.run(run()) == raw
