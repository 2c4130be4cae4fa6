"""`proxy.http.dechunk.Dechunker`: the body of a chunked HTTP/1.1 message, however its bytes are cut
into reads, and an error on broken framing.

The expected bodies are the chunks' data joined, built by hand here; every split position of
the wire (including inside each chunk-size line and each CRLF) is fed in two reads, and the
whole wire byte by byte.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.readers import stream_reader  # noqa: F401
from timwatch.sidecar.proxy import native
from timwatch.sidecar.proxy.http import dechunk
from timwatch.sidecar.proxy.http.dechunk import Dechunker, DechunkError

# every test on the C reader and on the numba one
pytestmark = pytest.mark.usefixtures("stream_reader")

PARTS = [b"data: {}\n\n", b"x" * 300, b"\r\n0\r\n", b"hello" * 40, b"z"]


def _wire(parts: list[bytes], size: bytes = b"%x", trailer: bytes = b"") -> bytes:
    out = [size % len(p) + b"\r\n" + p + b"\r\n" for p in parts]
    return b"".join(out) + b"0\r\n" + trailer + b"\r\n"


def _feed(reads: list[bytes]) -> tuple[bytes, bool]:
    d = Dechunker()
    body = b"".join(d.feed(r) for r in reads)
    return body, d.done


@pytest.mark.parametrize(
    "size,trailer",
    [
        (b"%x", b""),
        (b"%X", b""),
        (b"%08x", b""),
        (b"%x;name=value", b""),
        (b"%x ", b""),
        (b"%x", b"x-trailer: 1\r\nx-other: 2\r\n"),
    ],
    ids=["lower", "upper", "zero-padded", "extension", "space", "trailers"],
)
def test_every_split_position_gives_the_body(size: bytes, trailer: bytes) -> None:
    wire = _wire(PARTS, size, trailer)
    want = b"".join(PARTS)
    for cut in range(len(wire) + 1):
        assert _feed([wire[:cut], wire[cut:]]) == (want, True), cut
    assert _feed([wire[i : i + 1] for i in range(len(wire))]) == (want, True)


def test_three_reads_at_every_pair_of_positions_in_the_first_chunk() -> None:
    wire = _wire(PARTS)
    want = b"".join(PARTS)
    first = len(b"a\r\n") + len(PARTS[0]) + 2  # the first chunk's size line, data and CRLF
    for a in range(first + 1):
        for b in range(a, first + 6):
            assert _feed([wire[:a], wire[a:b], wire[b:]]) == (want, True), (a, b)


def test_unfinished_message_is_not_done() -> None:
    wire = _wire(PARTS)
    body, done = _feed([wire[:-1]])
    assert body == b"".join(PARTS) and not done
    assert _feed([wire[:40]])[1] is False


@pytest.mark.parametrize(
    "wire",
    [
        b"g\r\n",  # not a hex digit
        b"\r\n",  # no size
        b";x\r\n",  # an extension without a size
        b"5\r\nhelloX\r\n",  # data longer than its size
        b"5\nhello\r\n",  # LF without CR after the size
        b"5\r\nhello\r\r",  # CR not followed by LF after the data
        b"0\r\n\r\nX",  # a byte after the end
        b"1234567890abcdef0\r\n",  # more than 15 hex digits
        b"5;ext\n",  # an extension ended by a bare LF
        b"0\r\nx-t: 1\r\r",  # a trailer line ended by CR CR
    ],
)
def test_broken_framing_raises(wire: bytes) -> None:
    d = Dechunker()
    with pytest.raises(DechunkError):
        d.feed(wire)
    assert not d.done


def test_broken_framing_raises_when_cut_anywhere() -> None:
    wire = _wire(PARTS[:2]) + b"X"
    for cut in range(len(wire)):
        d = Dechunker()
        with pytest.raises(DechunkError):
            d.feed(wire[:cut])
            d.feed(wire[cut:])


def test_upstream_reads_a_chunked_answer_whole_and_keeps_the_connection() -> None:
    """`Upstream` takes any chunked body raw (here an error answer read with ``read``, as the
    proxy passes non-200 answers back), trailers included, and reuses the connection after."""
    import asyncio

    from timwatch.sidecar.proxy.http.client import Upstream

    wire = _wire(PARTS, b"%X;e=1", b"x-trailer: 1\r\n")

    async def run() -> tuple[list[tuple[int, bytes]], int]:
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            for status in (500, 200):
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
                head = b"HTTP/1.1 %d X\r\ntransfer-encoding: chunked\r\n\r\n" % status
                for i in range(0, len(head + wire), 7):  # many small writes
                    writer.write((head + wire)[i : i + 7])
                    await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        up = Upstream(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", timeout_s=10)
        got = []
        try:
            for _ in range(2):
                resp = await up.request("POST", "/generate", [], b"{}")
                got.append((resp.status, await resp.read()))
                resp.release()
        finally:
            await up.aclose()
            server.close()
            await server.wait_closed()
        return got, connections

    got, connections = asyncio.run(run())
    assert got == [(500, b"".join(PARTS)), (200, b"".join(PARTS))]
    assert connections == 1


def _released(reads: list[bytes]) -> list[int]:
    """After each read, how far `Dechunker.feed_raw` lets the bytes fed so far be relayed."""
    d, fed, out = Dechunker(), 0, []
    for r in reads:
        _, safe = d.feed_raw(r)
        out.append(fed + safe)
        fed += len(r)
    return out


@pytest.mark.parametrize(
    "size,trailer",
    [(b"%x", b""), (b"%08x", b""), (b"%x;name=value", b""), (b"%x", b"x-trailer: 1\r\n")],
    ids=["lower", "zero-padded", "extension", "trailers"],
)
def test_raw_relay_releases_every_chunk_but_the_last_however_cut(
    size: bytes, trailer: bytes
) -> None:
    wire = _wire(PARTS, size, trailer)
    last = len(wire) - len(b"0\r\n" + trailer + b"\r\n")
    cuts = [[wire[:c], wire[c:]] for c in range(len(wire) + 1)]
    cuts.append([wire[i : i + 1] for i in range(len(wire))])
    for reads in cuts:
        released = _released(reads)
        assert released[-1] == last  # the last chunk (and trailer) is never released
        fed = 0
        for got, r in zip(released, reads, strict=True):
            fed += len(r)
            assert 0 <= got <= fed
            held = wire[got:fed]
            # only a size line that may still be the last chunk's is held back
            assert held == b"" or held.startswith(b"0"), (reads, got, fed)
            assert got >= min(fed, last) - len(held)
        assert released == sorted(released)


def _trace(reads: list[bytes]) -> list[tuple[bytes, int, bool] | str]:
    """What `Dechunker.feed_raw` gives read by read (body, releasable bytes, done), or the
    error it raised."""
    d, out = Dechunker(), []
    for r in reads:
        try:
            body, safe = d.feed_raw(r)
        except DechunkError:
            out.append("error")
            break
        out.append((body, safe, d.done))
    return out


def test_reads_given_as_views_read_as_the_same_bytes() -> None:
    """The upstream connection hands on the body after a response head as a view of the read
    it came in (not a copy): views, offset into a larger buffer, de-chunk and release exactly
    as the same bytes do."""
    wire = _wire(PARTS, b"%x;e=1", b"x-trailer: 1\r\n")
    framed = b"HTTP/1.1 200 OK\r\n\r\n" + wire
    at = framed.index(wire)
    for cut in range(len(wire) + 1):
        views = [memoryview(framed)[at : at + cut], memoryview(framed)[at + cut :]]
        assert _trace(views) == _trace([wire[:cut], wire[cut:]]), cut
    broken = b"x\r\nabc\r\n"
    assert _trace([memoryview(b"?" + broken)[1:]]) == _trace([broken]) == ["error"]


def test_reads_of_one_chunk_each_are_taken_apart_as_the_compiled_pass_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the numba pass, a read that is exactly one chunk (how a proxy that keeps up reads an
    engine decoding) skips the compiled pass (the C pass takes every read); each read's body,
    releasable count and doneness, and where an error is raised, are what the compiled pass
    alone gives, for reads that are one chunk, that are not quite one, or that follow a read
    which ended inside a chunk."""
    wire = _wire(PARTS)
    chunks = [b"%x\r\n%s\r\n" % (len(p), p) for p in PARTS] + [b"0\r\n\r\n"]
    assert b"".join(chunks) == wire
    cases = [
        chunks,
        [chunks[0] + chunks[1], *chunks[2:]],
        [chunks[0][:-1], chunks[0][-1:], *chunks[1:]],  # the CRLF split: no boundary after
        [chunks[0][:3], chunks[0][3:], *chunks[1:]],
        [b"%X\r\n%s\r\n" % (len(p), p) for p in PARTS] + [b"0\r\n\r\n"],
        [b"%015x\r\n%s\r\n" % (len(p), p) for p in PARTS] + [b"0\r\n\r\n"],
        [b"%016x\r\n%s\r\n" % (len(p), p) for p in PARTS],  # 16 digits: an error
        [b"%x;e=1\r\n%s\r\n" % (len(p), p) for p in PARTS] + [b"0\r\n\r\n"],  # extension
        [chunks[0], b"5\r\nhelloX\r\n"],  # data longer than its size
        [chunks[0], b"5\r\nhell\r\n"],  # shorter
        [chunks[0], b"5\r\nhello\n\r", b"0\r\n\r\n"],
        [chunks[0], b"0\r\n\r\n", chunks[1]],  # a chunk after the end
        [chunks[0], b"+5\r\nhello\r\n"],
        [chunks[0], b"0x5\r\nhello\r\n"],
    ]
    for reads in cases:
        monkeypatch.setattr(dechunk, "ONE_CHUNK_FAST", True)
        fast = _trace(reads)
        monkeypatch.setattr(dechunk, "ONE_CHUNK_FAST", False)
        assert fast == _trace(reads), reads
    monkeypatch.setattr(dechunk, "ONE_CHUNK_FAST", True)
    calls: list[int] = []
    c = native.cstream()
    if c is None:
        compiled = dechunk._dechunk

        def counted(buf: Any, out: Any, state: Any) -> int:
            calls.append(len(buf))
            return int(compiled(buf, out, state))

        monkeypatch.setattr(dechunk, "_dechunk", counted)
    else:

        class Counted:
            @staticmethod
            def dechunk(data: bytes, state: Any) -> bytes:
                calls.append(len(data))
                return bytes(c.dechunk(data, state))

        monkeypatch.setattr(dechunk, "cstream", lambda: Counted)
    _trace(chunks)
    if c is None:
        assert calls == [len(b"0\r\n\r\n")]  # only the last chunk took the compiled pass
    else:
        assert calls == [len(x) for x in chunks]  # the C pass takes every read


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=12),
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
    st.sampled_from([b"%x", b"%X", b"%04x"]),
)
def test_any_reads_of_whole_chunks_give_what_the_compiled_pass_gives(
    parts: list[bytes], groups: list[int], size: bytes
) -> None:
    """Chunks (any bytes, CRLFs included) grouped into reads of 0-3 whole chunks, or cut in
    the middle where a group is 0: the same trace with and without the one-chunk path."""
    chunks = [size % len(p) + b"\r\n" + p + b"\r\n" for p in parts] + [b"0\r\n\r\n"]
    reads, i = [], 0
    for g in groups * 4:
        if i >= len(chunks):
            break
        if g == 0:
            reads.append(chunks[i][: len(chunks[i]) // 2])
            chunks[i] = chunks[i][len(chunks[i]) // 2 :]
            continue
        reads.append(b"".join(chunks[i : i + g]))
        i += g
    reads.append(b"".join(chunks[i:]))
    reads = [r for r in reads if r]
    try:
        dechunk.ONE_CHUNK_FAST = False
        want = _trace(reads)
    finally:
        dechunk.ONE_CHUNK_FAST = True
    assert _trace(reads) == want
    assert want[-1] != "error" and want[-1][2]  # type: ignore[index]
    assert b"".join(t[0] for t in want) == b"".join(parts)  # type: ignore[index]
