"""`proxy.sglang.deltascan`: an incremental stream's reads captured without searching each frame for
its keys give what the general scan (`scan.scan_frames` + orjson) gives on the same bytes,
wherever the reads are cut; frames it must not read are left to that scan.

Streams are built here in SGLang's compact format (one ``data: {...}\\n\\n`` frame per token,
``output_token_logprobs_length`` since 0.5.3), with token texts that start like the keys the
scan looks for, a long text followed by short ones (a frame much shorter than the one before),
log-probs in every shape JSON allows, and token ids of every length.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.readers import stream_reader  # noqa: F401
from timwatch.sidecar.proxy.records import HeldRecord
from timwatch.sidecar.proxy.sglang import stream as relay
from timwatch.sidecar.proxy.sglang.answers import Capturer
from timwatch.sidecar.proxy.sglang.deltascan import scan_deltas
from timwatch.sidecar.proxy.sglang.wire import SampleState, plan_request

# every test on the C reader and on the numba one
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


class _Recorder:
    """Stands in for `relay._Stream`: keeps what `relay._read_small` delivers."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}
        self.logps: dict[int, list[int]] = {}  # float64 bits: -0.0 and 0.0 differ
        self.totals: dict[int, int] = {}
        self.others: list[bytes] = []

    def delta(self, idx: int, ids: np.ndarray, logps: np.ndarray, total: int) -> None:
        self.ids.setdefault(idx, []).extend(ids.tolist())
        self.logps.setdefault(idx, []).extend(logps.view(np.int64).tolist())
        self.totals[idx] = total

    def frame(self, frame: bytes) -> None:
        self.others.append(bytes(frame))

    def state(self) -> tuple[Any, ...]:
        return self.ids, self.logps, self.totals, self.others


def _read(buf: bytes, fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    monkeypatch.setattr(relay, "FAST_DELTAS", fast)
    rec = _Recorder()
    end = relay._read_small(rec, buf, 0)  # type: ignore[arg-type]
    return end, rec.state()


def test_every_cut_reads_as_the_general_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read ending at every byte position of a 24-frame stream, and starting at every frame:
    the same deltas (ids, log-prob bits, totals), the same other frames, the same end."""
    raw = _stream(24)
    starts = [0] + [i + 2 for i in range(len(raw)) if raw.startswith(b"\n\n", i)][:-1]
    for start in starts[:4] + starts[-3:]:
        for cut in range(start, len(raw) + 1):
            buf = raw[start:cut]
            assert _read(buf, True, monkeypatch) == _read(buf, False, monkeypatch), (start, cut)


def test_the_fast_scan_reads_plain_deltas_and_stops_at_the_last_frame() -> None:
    raw = _stream(30)
    view = np.frombuffer(raw, np.uint8)
    rows, used, ids, logps, stopped = scan_deltas(view)
    last = raw.rindex(b"data: {")
    assert (used, stopped) == (last, True)
    assert rows.tolist() == [[0, last, 1, 0, 29, 29, 0]]  # one row for the 29 deltas
    frames = [orjson.loads(f[6:]) for f in raw[:last].split(b"\n\n")[:-1]]
    want = [f["meta_info"]["output_token_logprobs"][0] for f in frames]
    assert ids.tolist() == [w[1] for w in want]
    got_bits = [struct.pack("<d", v) for v in logps.tolist()]
    assert got_bits == [struct.pack("<d", float(w[0])) for w in want]


@pytest.mark.parametrize(
    "raw",
    [
        b"".join(_frame(i, 9, "a", "-0.5", i, index=0) for i in range(1, 9)),  # a batch's chunks
        _stream(6).replace(b'"input_token_logprobs":[]', b'"output_top_logprobs":[[]]', 1),
        _stream(6).replace(b'"finish_reason":null', b'"finish_reason":null,"finish_reason":null'),
        _stream(6).replace(b'"text":"', b'"text":"\\n\\"fi', 2),
        _stream(6)[:-14] + b"\n\n" + _stream(3),
    ],
    ids=["index", "top-k", "key-twice", "escaped-key-start", "empty-frame"],
)
def test_reads_it_must_not_take_are_left_to_the_general_scan(
    raw: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _read(raw, True, monkeypatch) == _read(raw, False, monkeypatch)
    rows, used, *_ = scan_deltas(np.frombuffer(raw, np.uint8))
    if b'"index":' in raw or b'"output_top_logprobs":' in raw or b'null,"finish' in raw:
        assert used <= 0 and not len(rows)  # every frame has one: none is taken


def test_a_frame_end_skipped_over_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame far shorter than the one before: its end lies before where the search starts;
    the count of marks notices the merged frame and the general scan reads the read."""
    long = _frame(1, 9, "x" * 900, "-1.5", 3)
    short = b"".join(_frame(i, 9, "", "-2.5", 4) for i in range(2, 6))
    raw = long + short
    assert _read(raw, True, monkeypatch) == _read(raw, False, monkeypatch)
    rows, used, ids, _, _ = scan_deltas(np.frombuffer(raw, np.uint8))
    assert used == -1 or (used == len(raw) and len(ids) == 5)


_FLOAT_TOKENS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(-(10**20), 10**20).map(str),
    st.tuples(st.integers(0, 10**18), st.integers(0, 40), st.booleans()).map(
        lambda t: f"{'-' if t[2] else ''}{t[0] // 10 ** t[1] if t[1] < 19 else 0}.{t[0]:0{t[1]}d}"
    ),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_FLOAT_TOKENS, min_size=1, max_size=12))
def test_log_probs_are_orjsons_floats_bit_for_bit(tokens: list[str]) -> None:
    tokens = [t.replace("inf", "1e400") for t in tokens]
    raw = b"".join(_frame(i + 1, 99, "t", tok, i) for i, tok in enumerate(tokens))
    rows, used, ids, logps, _ = scan_deltas(np.frombuffer(raw, np.uint8))
    if used <= 0:
        return  # a token only the general scan reads (orjson decides)
    frames = raw[:used].split(b"\n\n")[:-1]
    want = [orjson.loads(f[6:])["meta_info"]["output_token_logprobs"][0][0] for f in frames]
    assert logps.view(np.int64).tolist() == np.array(want, dtype=np.float64).view(np.int64).tolist()


def _object_records(raw: bytes) -> dict[str, Any]:
    state = SampleState()
    for frame in raw.split(b"\n\n"):
        if frame.startswith(b"data: {"):
            out = orjson.loads(frame[6:])
            state.offer(out)
            if out["meta_info"]["finish_reason"] is not None:
                rec = state.record(out["meta_info"], fallback_prompt=None, vocab_size=None)
                return {rec.rid: rec}
    return {}


@pytest.mark.parametrize("batch", [1, relay.BATCH_BYTES], ids=["each-read", "kept"])
def test_stream_capture_at_every_two_read_cut_equals_the_object_path(
    batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`relay.stream_capture` (what the raw relay feeds) with the stream cut into two reads at
    every byte, each read as it comes or both kept until `close`: the record is the object
    path's."""
    monkeypatch.setattr(relay, "BATCH_BYTES", batch)
    raw = _stream(14, shift=3)
    body = {"input_ids": [1, 2, 3], "return_logprob": True, "stream": True}
    plan = plan_request(body, None)
    assert plan is not None
    want = _object_records(raw)["abc"]
    for cut in range(len(raw) + 1):
        got: list[HeldRecord] = []
        counters = {"requests": 0, "wire_errors": 0, "upstream_errors": 0}
        feed = relay.stream_capture(Capturer(got.append, counters, None), plan)
        for part in (raw[:cut], raw[cut:]):
            if part:
                feed(part)
        feed.close()
        assert counters["wire_errors"] == 0
        (rec,) = [h.unpack() for h in got]
        assert rec.output_ids == want.output_ids, cut
        assert np.array_equal(
            np.asarray(rec.logp).view(np.int64), np.asarray(want.logp).view(np.int64)
        )


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
    got: list[HeldRecord] = []
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
    want = _object_records(raw)["abc"]
    got: list[HeldRecord] = []
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
    (rec,) = [h.unpack() for h in got]
    assert rec.output_ids == want.output_ids
    assert np.array_equal(np.asarray(rec.logp).view(np.int64), np.asarray(want.logp).view(np.int64))


def test_relay_stream_through_the_fast_path_keeps_bytes() -> None:
    raw = _stream(20)
    plan = plan_request({"input_ids": [1], "return_logprob": True, "stream": True}, None)
    assert plan is not None

    async def run() -> bytes:
        async def chunks() -> AsyncIterator[bytes]:
            for at in range(0, len(raw), 997):
                yield raw[at : at + 997]

        cap = Capturer(lambda r: None, {"wire_errors": 0}, None)
        return b"".join([c async for c in relay.relay_stream(cap, plan, chunks())])

    assert asyncio.run(run()) == raw
