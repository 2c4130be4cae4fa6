"""A fast stand-in for SGLang 0.5.x's ``/generate``, for throughput benchmarks only.

`tests/helpers/fake_sglang.py` computes a real distribution per token, which costs more per
token than the proxy in front of it. This one answers from precomputed bytes in SGLang's
compact orjson format (same keys and order), so it is not the bottleneck: per request it parses
the body with orjson and writes cached bytes (non-streamed), or the frames of a cumulative or
incremental stream (``--incremental-streaming-output``), one ``data: ...\\n\\n`` frame per token
as SGLang sends with ``stream_interval = 1``. Each answer gets a fresh ``meta_info.id``.
A stream is rendered once per request shape and then written in ~256 kB pieces (the id joined
in), so the stand-in costs a few copies per stream, not Python per frame: what it delivers is
what a real engine's many small writes deliver to a busy proxy, coalesced reads. The rendered
streams stay in memory (a 4,096-token cumulative one is 339 MB). With ``--step-ms`` a stream is
written as an engine decoding writes it instead: one frame (one HTTP chunk) per decode step,
``--step-ms`` apart, so a proxy that keeps up gets one frame per read; ``--frames`` writes it so
with no wait between frames (an engine decoding as fast as it can).

Plain asyncio streams and httptools (`standin_http`); HTTP/1.1 keep-alive; chunked encoding
for streams.

    python benchmarks/sglang_standin.py --port 30000 [--incremental-streaming-output]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
from typing import Any

import orjson
from standin_http import HttpRequest, Joined, serve

VOCAB = 151_936
_ids = itertools.count()


def _token(i: int) -> tuple[int, float]:
    return (i * 7919 + 13) % VOCAB, -abs(math.sin(i * 0.37)) * 3.0 - 1e-3


class Answers:
    """Joined byte pieces of answers, cached by (tokens, logprob, topk)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, bool, int], tuple[bytes, Joined, Joined, Joined]] = {}

    def pieces(self, n: int, lp: bool, k: int) -> tuple[bytes, Joined, Joined, Joined]:
        key = (n, lp, k)
        if key not in self.cache:
            toks = [_token(i) for i in range(n)]
            text = b"".join(chr(97 + t % 26).encode() for t, _ in toks)
            ids = Joined([str(t).encode() for t, _ in toks])
            trip = Joined([orjson.dumps([lp_, t, None]) for t, lp_ in toks] if lp else [])
            rows = [
                orjson.dumps([[lp_ - 0.1 * j, (t + j) % VOCAB, None] for j in range(k)])
                for t, lp_ in toks
            ]
            self.cache[key] = (text, ids, trip, Joined(rows if lp and k else []))
        return self.cache[key]


def _answer(
    pieces: tuple[bytes, Joined, Joined, Joined],
    n: int,
    lo: int,
    hi: int,
    shape: tuple[bool, int, bool],
    rid: bytes,
    finish: bool,
    prompt: bytes,
) -> bytes:
    lp, k, pids = shape
    text_all, id_runs, trip, rows = pieces
    text = text_all[lo:hi]
    ids = id_runs.run(lo, hi)
    fin = b'{"type":"length","length":%d}' % n if finish else b"null"
    meta = [
        b'{"id":"',
        rid,
        b'","finish_reason":',
        fin,
        b',"prompt_tokens":16,"weight_version":"default","num_retractions":0',
    ]
    if lp:
        meta += [
            b',"input_token_logprobs":[],"output_token_logprobs":[',
            trip.run(lo, hi),
            b'],"output_token_logprobs_length":%d' % hi,
        ]
        if k:
            meta += [
                b',"input_top_logprobs":[],"output_top_logprobs":[',
                rows.run(lo, hi),
                b"]",
            ]
    meta += [
        b',"reasoning_tokens":0,"completion_tokens":%d,"cached_tokens":0' % hi,
        b',"weight_versions":[{"version":"default","start":0,"end":%d}]' % hi,
    ]
    if finish:
        meta.append(b',"e2e_latency":0.01')
    body = [b'{"text":"', text, b'","output_ids":[', ids, b'],"meta_info":', *meta, b"}"]
    if pids:
        body += [b',"prompt_token_ids":', prompt]
    body.append(b"}")
    return b"".join(body)


async def _handle(
    req: HttpRequest,
    writer: asyncio.StreamWriter,
    answers: Answers,
    streams: Streams,
    decode_s: float = 0.0,
    step_s: float = 0.0,
    frames: bool = False,
) -> None:
    if req.url.startswith(b"/health"):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        return
    body: dict[str, Any] = orjson.loads(bytes(req.body))
    if decode_s:
        await asyncio.sleep(decode_s)
    await _generate(body, writer, answers, streams, step_s, frames)
    await writer.drain()


# Stands for the 32 hex digits of an answer's id in a pre-rendered stream (same length, so the
# chunk sizes written around it stay right).
_RID = b"\x00" * 32


class Streams:
    """Whole streams pre-rendered once per request shape as the bytes on the wire (chunked
    encoding included), split where the answer's id goes: an answer is then a few big writes."""

    def __init__(self, answers: Answers, incremental: bool) -> None:
        self.answers, self.incremental = answers, incremental
        self.chunks: dict[tuple[int, bool, int, bool, bytes], list[bytes]] = {}
        self.cache: dict[tuple[int, bool, int, bool, bytes], list[bytes]] = {}

    def frames(self, n: int, shape: tuple[bool, int, bool], prompt: bytes) -> list[bytes]:
        """The stream's chunks one frame each (the last also holds ``[DONE]`` and the last
        chunk), each with `_RID` where the answer's id goes."""
        key = (n, *shape, prompt)
        if key not in self.chunks:
            self.chunks[key] = self._render(n, shape, prompt)
        return self.chunks[key]

    def segments(self, n: int, shape: tuple[bool, int, bool], prompt: bytes) -> list[bytes]:
        """The whole stream split where the answer's ids go."""
        key = (n, *shape, prompt)
        if key not in self.cache:
            self.cache[key] = b"".join(self._render(n, shape, prompt)).split(_RID)
        return self.cache[key]

    def _render(self, n: int, shape: tuple[bool, int, bool], prompt: bytes) -> list[bytes]:
        pieces = self.answers.pieces(n, shape[0], shape[1])
        parts = []
        for i in range(1, n + 1):
            lo = i - 1 if self.incremental else 0
            frame = b"data: " + _answer(pieces, n, lo, i, shape, _RID, i == n, prompt) + b"\n\n"
            parts.append(b"%x\r\n%s\r\n" % (len(frame), frame))
        parts.append(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        return parts


def answer_bytes(n: int, answer_id: int = 1) -> bytes:
    """The body of a non-streamed ``n``-token answer (``return_logprob``, no top-k), as a request
    for it is answered: for benchmarks that read or move the bytes without a server."""
    pieces = Answers().pieces(n, True, 0)
    return _answer(pieces, n, 0, n, (True, 0, False), b"%032x" % answer_id, True, b"[1]")


def stream_bytes(n: int, incremental: bool, answer_id: int = 2) -> bytes:
    """The whole chunked body of the same answer streamed (cumulative or incremental frames,
    ``[DONE]`` and the last chunk included), as the stand-in writes it."""
    segments = Streams(Answers(), incremental).segments(n, (True, 0, False), b"[1]")
    return (b"%032x" % answer_id).join(segments)


async def _generate(
    body: dict[str, Any],
    writer: asyncio.StreamWriter,
    answers: Answers,
    streams: Streams,
    step_s: float = 0.0,
    frames: bool = False,
) -> None:
    n = int(body.get("sampling_params", {}).get("max_new_tokens", 16))
    lp = bool(body.get("return_logprob"))
    k = int(body.get("top_logprobs_num") or 0)
    pids = bool(body.get("return_prompt_token_ids"))
    shape = (lp, k, pids)
    pieces = answers.pieces(n, lp, k)
    rid = b"%032x" % next(_ids)
    prompt = orjson.dumps(body.get("input_ids") or list(range(16)))
    if not body.get("stream"):
        out = _answer(pieces, n, 0, n, shape, rid, True, prompt)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(out) + out
        )
        return
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    if step_s or frames:
        for frame in streams.frames(n, shape, prompt):
            writer.write(frame.replace(_RID, rid))
            await writer.drain()
            await asyncio.sleep(step_s)
        return
    segments = streams.segments(n, shape, prompt)
    # about 256 kB per write, each id filled in by the join
    step = max(1, (256 << 10) * len(segments) // sum(map(len, segments)))
    for lo in range(0, len(segments), step):
        part = rid.join(segments[lo : lo + step])
        writer.write(part + rid if lo + step < len(segments) else part)
        # drained after every piece: Python 3.11's transport moves its whole unsent buffer
        # down after each partial send, so a deep buffer costs more than the data it holds
        await writer.drain()
        await asyncio.sleep(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--incremental-streaming-output", action="store_true")
    ap.add_argument(
        "--decode-ms",
        type=float,
        default=0.0,
        help="wait this long before each /generate answer, as a real engine decodes",
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="write a stream one frame per decode step, this far apart (0: in big pieces)",
    )
    ap.add_argument(
        "--frames",
        action="store_true",
        help="write a stream one frame (one chunk) per write even at --step-ms 0, yielding to "
        "the event loop between frames: an engine decoding as fast as it can",
    )
    args = ap.parse_args()
    answers = Answers()
    streams = Streams(answers, args.incremental_streaming_output)
    decode_s, step_s = args.decode_ms / 1e3, args.step_ms / 1e3
    serve(
        args.port,
        lambda req, w: _handle(req, w, answers, streams, decode_s, step_s, args.frames),
    )


if __name__ == "__main__":
    main()
