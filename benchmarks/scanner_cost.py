"""CPU of the SGLang proxy's stream and answer readers, in process, on the stand-in's bytes: the
C reader (``sidecar/proxy/native/_cstream.c``) against the orjson fallback that runs without it.

The answer and the incremental stream are `benchmarks/sglang_standin.py`'s (SGLang's compact
orjson bytes, ``return_logprob``, no top-k). Timed, best of ``--repeat`` calls, C and fallback
interleaved, their ratio printed:

* ``triples``: the ``[[logprob,id,null],...]`` list of one non-streamed answer read into an id
  array and a float64 array (fallback: orjson on the list, then the arrays);
* ``dechunk``: one incremental stream's chunked body undone, in reads of ``--read`` bytes, and
  its first frames read one chunk per read (what a proxy keeping up with an engine reads); the
  C pass, and where it is off llhttp's callbacks (the upstream client's fallback);
* ``scan_deltas``: the same stream's de-chunked reads cut into frames and read (fallback:
  orjson on every frame);
* ``capture``: the whole capture of that stream as the raw relay feeds it
  (`relay.stream_capture`, read by read, then closed: one record).

The C rows need the extension built (``pip install -e .`` with a C compiler).

    python benchmarks/scanner_cost.py [--tokens 4096] [--read 262144] [--repeat 100]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httptools  # noqa: E402
import numpy as np  # noqa: E402
import orjson  # noqa: E402
import sglang_standin as standin  # noqa: E402

from timwatch.sidecar.proxy import native  # noqa: E402
from timwatch.sidecar.proxy.http import dechunk as dechunk_mod  # noqa: E402
from timwatch.sidecar.proxy.records import RolloutRecord  # noqa: E402
from timwatch.sidecar.proxy.sglang import stream as relay  # noqa: E402
from timwatch.sidecar.proxy.sglang.answers import Capturer  # noqa: E402
from timwatch.sidecar.proxy.sglang.wire import plan_request  # noqa: E402


def _dechunker() -> Callable[[bytes], bytes]:
    """The upstream client's de-chunking: the C pass, or llhttp's callbacks where it is off."""
    if dechunk_mod.available():
        d = dechunk_mod.Dechunker()
        return lambda data: d.feed(data)[0]
    got: list[bytes] = []

    class Sink:
        on_body = got.append

    parser = httptools.HttpResponseParser(Sink())
    parser.feed_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")

    def feed(data: bytes) -> bytes:
        parser.feed_data(data)
        body = b"".join(got)
        got.clear()
        return body

    return feed


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--read", type=int, default=262144, help="bytes per network read")
    ap.add_argument("--repeat", type=int, default=100)
    args = ap.parse_args()
    n = args.tokens
    answer = standin.answer_bytes(n)
    raw = standin.stream_bytes(n, incremental=True)
    reads = [raw[i : i + args.read] for i in range(0, len(raw), args.read)]
    key = b'"output_token_logprobs":'
    at = answer.find(key) + len(key)
    end = answer.find(b',"output_token_logprobs_length"', at)

    def triples() -> tuple[np.ndarray, np.ndarray]:
        if native.cstream() is not None:
            count, _, ids, logps = native.triples(answer, at)
            return ids, logps
        rows = orjson.loads(answer[at:end])
        return (
            np.array([r[1] for r in rows], dtype=np.int64),
            np.array([r[0] for r in rows], dtype=np.float64),
        )

    def dechunk() -> list[bytes]:
        feed = _dechunker()
        return [feed(r) for r in reads]

    bodies = dechunk()

    def scan() -> int:
        tail, tokens = b"", 0
        for body in bodies:
            buf = tail + body
            if native.cstream() is not None:
                _, used, ids, _, _ = native.scan_deltas(buf, 4096)
                tokens += len(ids)
            else:
                used = buf.rfind(b"\n\n") + 2
                for frame in buf[:used].split(b"\n\n")[:-1]:
                    if not frame.startswith(b"data: {"):
                        continue
                    meta = orjson.loads(frame[6:])["meta_info"]
                    if meta["finish_reason"] is None:
                        tokens += len(meta["output_token_logprobs"])
            tail = buf[max(used, 0) :]
        return tokens

    plan = plan_request({"input_ids": [1], "return_logprob": True, "stream": True}, None)
    assert plan is not None

    def capture() -> None:
        got: list[RolloutRecord] = []
        counters = {"requests": 0, "wire_errors": 0, "upstream_errors": 0}
        feed = relay.stream_capture(Capturer(got.append, counters, None), plan)
        for body in bodies:
            feed(body)
        feed.close()
        assert len(got) == 1 and got[0].num_tokens == n, got

    built = native.built()
    want = None
    for on in (True, False) if built else (False,):
        native.use_native(on)
        ids, logps = triples()
        assert len(ids) == n and (want is None or np.array_equal(logps, want)), len(ids)
        want = logps
        # the last frame (finished) is read on its own: every other token is read here
        assert scan() == n - 1, scan()
        assert dechunk() == bodies
        capture()
    print(
        f"C reader {'built' if built else 'NOT built: fallback only'}; "
        f"{n}-token answer {len(answer):,} bytes, incremental stream {len(raw):,} bytes in "
        f"{len(reads)} reads of {args.read:,}"
    )
    one_chunk_reads, pos = [], 0
    while len(one_chunk_reads) < 200:  # the stream's first chunks, each read alone
        size_end = raw.index(b"\r\n", pos)
        chunk_end = size_end + 2 + int(raw[pos:size_end], 16) + 2
        one_chunk_reads.append(raw[pos:chunk_end])
        pos = chunk_end

    def one_frame() -> None:
        feed = _dechunker()
        for read in one_chunk_reads:
            feed(read)

    rows = (
        ("triples (one answer)", triples),
        (f"dechunk ({len(one_chunk_reads)} one-frame reads)", one_frame),
        ("dechunk (one stream)", dechunk),
        ("scan_deltas (one stream)", scan),
        ("capture (one stream)", capture),
    )
    print(f"{'':30} {'C':>10} {'fallback':>10} {'C/fallback':>10}")
    for name, fn in rows:
        c_ms, fb_ms = [], []
        for _ in range(3):  # interleaved: the machine's drift hits both alike
            if built:
                native.use_native(True)
                c_ms.append(best_ms(fn, args.repeat))
            native.use_native(False)
            fb_ms.append(best_ms(fn, args.repeat))
        if built:
            c, b = min(c_ms), min(fb_ms)
            print(f"{name:30} {c:7.3f} ms {b:7.3f} ms {c / b:10.2f}")
        else:
            print(f"{name:30} {'-':>10} {min(fb_ms):7.3f} ms")


if __name__ == "__main__":
    main()
