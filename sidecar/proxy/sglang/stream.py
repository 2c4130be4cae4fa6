"""Capturing ``/generate`` streams while relaying them to the client.

Where the C reader is built (`native`), runs of one sample's small delta frames are read by
`native.scan_deltas` and every other chunk on its bytes (`proxy.sglang.fastwire`); whatever
that path refuses (token text in the log-probs, a number it does not convert exactly, SGLang
before 0.5.3) takes the object path (`proxy.sglang.wire`, orjson on the whole frame), which
is also the only path without the C reader. Both give the client the same bytes and the same
records: either path's reads of a sample go to its one `wire.SampleState`, so a sample refused
mid-stream goes on on the object path with what it held.
Non-streamed answers: `proxy.sglang.answers`.

Streams are cut into ``data: ...\\n\\n`` frames as bytes arrive, searching only the bytes not
searched yet, and every frame complete in one read is relayed in one write (a changed
request's stream by `proxy.http.sse.relay_frames`, as the vLLM proxy's).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import numpy as np

from ..http.sse import relay_frames, terminator
from ..native import cstream, scan_deltas
from .answers import Capturer
from .fastwire import (
    MAX_TRIPLE,
    MIN_TRIPLE,
    NotFast,
    cumulative,
    finished,
    int_value,
    read_bytes,
    restore,
    small_meta,
)
from .wire import (
    Chunk,
    RequestPlan,
    SampleState,
    WireError,
    dumps,
    is_finished,
    loads,
    read_object,
)

__all__ = ["BATCH_BYTES", "StreamReads", "relay_stream", "stream_capture"]

log = logging.getLogger(__name__)

# Stream chunks up to this size are read by the C delta scan (`_read_small`), larger ones on
# their own.
_SMALL_FRAME = 4096
# Reads shorter than this are kept and read together (`StreamReads`): an engine decoding writes
# one frame per token, so a proxy that keeps up gets one frame per read, and reading each alone
# cost several times the frame's bytes.
BATCH_BYTES = 64 << 10


def _read_held(payload: bytes) -> Chunk:
    """A held cumulative chunk read when it is needed: on its bytes, else as objects."""
    try:
        return read_bytes(payload)[0]
    except NotFast:
        return read_object(loads(payload))


class _Stream:
    """The samples of one streamed request. Each chunk is read on its bytes (`fastwire`) or, once
    that path refused one of a sample's chunks, as objects (`wire.read_object`); either way it
    goes to the sample's one `SampleState`. A sample with a malformed chunk is counted once as a
    wire error and not captured: its later chunks are relayed and not read."""

    def __init__(self, cap: Capturer, plan: RequestPlan) -> None:
        self.cap, self.plan = cap, plan
        self.samples: dict[int, SampleState] = {}
        self.on_objects: set[int] = set()
        self.refused: set[int] = set()
        self.indexed: bool | None = None  # whether its chunks carry "index" (batch requests)

    def _sample(self, idx: int) -> SampleState:
        sample = self.samples.get(idx)
        if sample is None:
            sample = self.samples[idx] = SampleState()
        return sample

    def _refuse(self, idx: int, exc: Exception) -> None:
        """A malformed chunk: the sample is dropped and counted as a wire error."""
        self.samples.pop(idx, None)
        self.refused.add(idx)
        self.cap.wire_error(f"stream sample {idx}", exc)

    def whole(self, buf: bytes, start: int, end: int) -> bool:
        """Hold ``buf[start:end]`` by reference if it is an unfinished cumulative chunk of the
        one sample of a request seen before on the byte path; False: read it with `frame`.

        Finds only ``finish_reason`` (near the start), the list and the total (near the end)
        and decides by the list's byte length as `fastwire.cumulative` does; anything it cannot
        decide that way, and any request whose first chunk read whole had an ``index``, goes
        to `frame`, which reads the chunk whole."""
        sample = self.samples.get(0)
        if sample is None or self.indexed is not False or self.on_objects:
            return False
        if not buf.startswith(b"data: {", start):
            return False
        k = buf.find(b'"finish_reason":', start, end)
        if k < 0 or buf[k + 16] != 110:  # not null: the last chunk
            return False
        t = buf.rfind(b'"output_token_logprobs_length":', k, end)
        if t < 0 or buf[t - 1] != 44 or buf.find(b'"index":', t, end) >= 0:
            return False  # SGLang writes a batch sample's "index" last
        v = t + 31
        ends = [e for e in (buf.find(b",", v, end), buf.find(b"}", v, end)) if e >= 0]
        try:
            total = int(buf[v : min(ends)]) if ends else -1
        except ValueError:
            return False
        lst = buf.find(b'"output_token_logprobs":', k, t)
        if total <= 0 or lst < 0:
            return False
        length, delta = t - 1 - (lst + 24), total - sample.total
        if delta != total and not (
            length >= MIN_TRIPLE * total and length > MAX_TRIPLE * delta + 2
        ):
            return False
        sample.hold(lambda: _read_held(buf[start + 6 : end - 2]), total)
        return True

    def delta(self, idx: int, ids: np.ndarray, logps: np.ndarray, total: int) -> None:
        """An unfinished chunk the C delta scan read (`_read_small`: an unchanged request's
        stream)."""
        if idx in self.refused:
            return
        try:
            self._sample(idx).add(Chunk(ids, logps, None, total))
        except (WireError, ValueError) as exc:
            self._refuse(idx, exc)

    def frame(self, frame: bytes) -> bytes:
        if not frame.startswith(b"data: {"):
            return frame
        payload = frame[6:-2]
        if cstream() is None:
            return self._objects(frame, payload)
        if self.indexed is None:
            self.indexed = payload.find(b'"index":') >= 0
        try:
            idx = int_value(payload, b"index") or 0
        except NotFast:
            return self._objects(frame, payload)
        if idx in self.on_objects:
            return self._objects(frame, payload)
        try:
            last = finished(payload)
            client = restore(payload, self.plan, self.plan.prompt_index(idx))
            total = int_value(payload, b"output_token_logprobs_length")
            if total is None:
                raise NotFast("no output_token_logprobs_length (SGLang before 0.5.3)")
        except NotFast:
            return self._objects(frame, payload)  # which moves the sample to the object path
        out = frame if client is payload else b"data: " + client + b"\n\n"
        if idx in self.refused:
            return out
        sample = self._sample(idx)
        try:
            if not last and cumulative(payload, total, total - sample.total):
                sample.hold(lambda: _read_held(payload), total)
                return out
            chunk, hole = read_bytes(payload)
            meta = small_meta(payload, hole) if last else None
        except NotFast:
            return self._objects(frame, payload)
        except (WireError, ValueError) as exc:
            self._refuse(idx, exc)  # the client still gets its restored bytes
            return out
        try:
            sample.add(chunk)
            if meta is not None:
                del self.samples[idx]
                self.cap.finish(sample, meta, self.plan, idx)
        except (WireError, ValueError) as exc:
            self._refuse(idx, exc)
        return out

    def _objects(self, frame: bytes, payload: bytes) -> bytes:
        try:
            out = loads(payload)
        except ValueError:
            return frame
        if not isinstance(out, dict) or "meta_info" not in out:
            return frame  # SGLang's in-stream {"error": ...} object
        idx = out.get("index", 0)
        idx = idx if isinstance(idx, int) else 0
        self.on_objects.add(idx)
        if idx not in self.refused:
            try:
                self._sample(idx).offer(out)
                if is_finished(out):
                    self.cap.finish(self.samples.pop(idx), out["meta_info"], self.plan, idx)
            except (WireError, ValueError) as exc:
                self._refuse(idx, exc)
        if not self.plan.changed:
            return frame
        self.plan.restore(out, idx)
        return b"data: " + dumps(out) + b"\n\n"


def relay_stream(
    cap: Capturer, plan: RequestPlan, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """Relay the SSE stream of a request the proxy changed, capturing finished samples on the
    way: each frame is restored on its own and every frame complete in one read goes out in one
    write (`proxy.http.sse.relay_frames`). An unchanged request's stream is relayed as it
    came and captured beside it (`stream_capture`)."""
    return relay_frames(_Stream(cap, plan).frame, chunks)


def stream_capture(cap: Capturer, plan: RequestPlan) -> StreamReads:
    """What captures an unchanged request's stream from its body bytes, fed read by read and
    closed at its end, when something else relays the bytes to the client
    (`proxy.http.relay.UpstreamStream`)."""
    return StreamReads(_Stream(cap, plan))


class StreamReads:
    """The frames of one stream cut out of its reads and captured. Reads shorter than
    `BATCH_BYTES` are kept until that many arrived, or until `close`, and read together;
    longer ones are never copied whole (a frame begun in one read is joined alone, from views
    of its pieces). `close` reads what is kept: every frame fed before it
    is captured, and a sample is committed once its finished frame is read. A capture that
    fails unexpectedly (a bug, not a malformed sample: those are counted per sample) is logged
    and counted as a wire error, and the rest of the stream is not captured; the relay, which
    calls this after sending the read on, goes on."""

    def __init__(self, stream: _Stream) -> None:
        self.stream = stream
        self.kept: list[bytes] = []  # short reads not read yet
        self.kept_bytes = 0
        self.held: list[memoryview] = []  # a frame still arriving, not yet copied
        self.failed = False

    def __call__(self, chunk: bytes) -> None:
        if self.failed:
            return
        if self.kept or len(chunk) < BATCH_BYTES:
            self.kept.append(chunk)
            self.kept_bytes += len(chunk)
            if self.kept_bytes < BATCH_BYTES:
                return
            chunk = self._take()
        self._capture(chunk)

    def close(self) -> None:
        """Read the reads still kept (the body ended, or its relay stopped); idempotent."""
        if self.kept and not self.failed:
            self._capture(self._take())

    def _take(self) -> bytes:
        kept, self.kept, self.kept_bytes = self.kept, [], 0
        return kept[0] if len(kept) == 1 else b"".join(kept)

    def _capture(self, chunk: bytes) -> None:
        try:
            self._read(chunk)
        except Exception:
            self.failed = True
            log.exception("stream capture failed; the rest of this stream is not captured")
            self.stream.cap.counters["wire_errors"] += 1

    def _read(self, chunk: bytes) -> None:
        if not chunk:
            return
        stream, held = self.stream, self.held
        buf, pos = chunk, 0
        if held:
            # the terminator may straddle two reads (compact JSON holds no raw newline)
            if chunk[:1] == b"\n" and held[-1][-1:] == b"\n":
                pos = 1
            elif (cut := terminator(chunk, 0)) >= 0:
                pos = cut + 2
            else:
                held.append(memoryview(chunk))
                return
            frame = b"".join([*held, memoryview(chunk)[:pos]])  # the one copy of the frame
            self.held = []
            if len(frame) > _SMALL_FRAME:
                self._long(frame, 0, len(frame))
            else:
                _read_small(stream, frame, 0)
        cut = terminator(buf, pos)
        if cut >= 0 and cut + 2 - pos > _SMALL_FRAME:
            # long frames (a cumulative stream): cut at memchr speed, each on its bytes
            while cut >= 0:
                self._long(buf, pos, cut + 2)
                pos = cut + 2
                cut = terminator(buf, pos)
        else:
            pos = _read_small(stream, buf, pos) if cut >= 0 else pos
        if pos < len(buf):
            self.held = [memoryview(buf)[pos:]]

    def _long(self, buf: bytes, start: int, end: int) -> None:
        if not self.stream.whole(buf, start, end):
            self.stream.frame(buf[start:end])


def _read_small(stream: _Stream, buf: bytes, pos: int) -> int:
    """Read the complete frames from ``buf[pos]``, the bytes not copied: runs of one sample's
    deltas by the C scan (`native.scan_deltas`), every frame it stops at, and every frame of a
    read it declines, by `_Stream.frame`; returns where the first frame not complete in ``buf``
    starts. Without the C reader every frame goes to `_Stream.frame`."""
    declined = cstream() is None
    while True:
        if not declined:
            rows, used, ids, logps, stopped = scan_deltas(
                np.frombuffer(buf, dtype=np.uint8)[pos:], _SMALL_FRAME
            )
            if used > 0:
                for _start, _end, _kind, idx, total, count, at in rows.tolist():
                    stream.delta(idx, ids[at : at + count], logps[at : at + count], total)
                pos += used
                if not stopped:
                    return pos
            declined = used < 0
        cut = terminator(buf, pos)
        if cut < 0:
            return pos
        stream.frame(buf[pos : cut + 2])
        pos = cut + 2
