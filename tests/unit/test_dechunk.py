"""`proxy.dechunk.Dechunker`: the body of a chunked HTTP/1.1 message, however its bytes are cut
into reads, and an error on broken framing.

The expected bodies are the chunks' data joined, built by hand here; every split position of
the wire (including inside each chunk-size line and each CRLF) is fed in two reads, and the
whole wire byte by byte.
"""

from __future__ import annotations

import pytest

from timwatch.sidecar.proxy.dechunk import Dechunker, DechunkError

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

    from timwatch.sidecar.proxy.upstream import Upstream

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
