"""`proxy.http.dechunk.Dechunker` (the C pass) against llhttp (httptools, the fallback's
de-chunker): the body of a chunked HTTP/1.1 message however its bytes are cut into reads, and
an error on broken framing.

Every split position of hand-built wires (inside each chunk-size line and each CRLF) is fed in
two reads, and the whole wire byte by byte; hypothesis generates chunked bodies (extensions,
trailers, sizes in any hex case, zero-padded), cuts them anywhere and changes bytes anywhere:
wherever llhttp accepts, the C pass gives the same body and the same end. Where they differ
(`test_where_the_c_pass_and_llhttp_differ`) the C pass is the more lenient, on syntax that
carries no body bytes.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.readers import httptools_dechunk, require_c, stream_reader  # noqa: F401
from timwatch.sidecar.proxy.http.client import Upstream
from timwatch.sidecar.proxy.http.dechunk import Dechunker, DechunkError

PARTS = [b"data: {}\n\n", b"x" * 300, b"\r\n0\r\n", b"hello" * 40, b"z"]


@pytest.fixture
def c_pass() -> None:
    require_c()


def _wire(parts: list[bytes], size: bytes = b"%x", trailer: bytes = b"") -> bytes:
    out = [size % len(p) + b"\r\n" + p + b"\r\n" for p in parts]
    return b"".join(out) + b"0\r\n" + trailer + b"\r\n"


def _c(reads: list[bytes | memoryview]) -> tuple[bytes, bool] | str:
    d = Dechunker()
    body = []
    try:
        for r in reads:
            body.append(d.feed(r)[0])
    except DechunkError:
        return "error"
    return b"".join(body), d.done


@pytest.mark.usefixtures("c_pass")
@pytest.mark.parametrize(
    "size,trailer",
    [
        (b"%x", b""),
        (b"%X", b""),
        (b"%08x", b""),
        (b"%x;name=value", b""),
        (b'%x;a=1;b="q s"', b""),
        (b"%x", b"x-trailer: 1\r\nx-other: 2\r\n"),
    ],
    ids=["lower", "upper", "zero-padded", "extension", "extensions", "trailers"],
)
def test_every_split_position_gives_the_body_llhttp_gives(size: bytes, trailer: bytes) -> None:
    wire = _wire(PARTS, size, trailer)
    want = (b"".join(PARTS), True)
    assert httptools_dechunk([wire]) == want
    for cut in range(len(wire) + 1):
        assert _c([wire[:cut], wire[cut:]]) == want, cut
    assert _c([wire[i : i + 1] for i in range(len(wire))]) == want


@pytest.mark.usefixtures("c_pass")
def test_unfinished_message_is_not_done() -> None:
    wire = _wire(PARTS)
    assert _c([wire[:-1]]) == httptools_dechunk([wire[:-1]]) == (b"".join(PARTS), False)
    assert _c([wire[:40]])[1] is False


@pytest.mark.usefixtures("c_pass")
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
        b"5;ext\n",  # an extension ended by a bare LF
        b"+5\r\nhello\r\n",
        b"0x5\r\nhello\r\n",
    ],
)
def test_broken_framing_is_refused_by_both(wire: bytes) -> None:
    d = Dechunker()
    with pytest.raises(DechunkError):
        d.feed(wire)
    assert not d.done
    assert httptools_dechunk([wire]) == "error"


@pytest.mark.usefixtures("c_pass")
def test_where_the_c_pass_and_llhttp_differ() -> None:
    """The documented differences: none changes a body either accepts."""
    body = (b"hello", True)
    # whitespace between the size and the CR or an extension: RFC 9112 allows none; the C
    # pass skips it as it skips extensions
    for wire in (b"5 \r\nhello\r\n0\r\n\r\n", b"5\t;x\r\nhello\r\n0\r\n\r\n"):
        assert _c([wire]) == body and httptools_dechunk([wire]) == "error"
    # extension and trailer syntax: the C pass skips them unread, llhttp checks their tokens
    for wire in (b"5;@\r\nhello\r\n0\r\n\r\n", b"5\r\nhello\r\n0\r\nno colon\r\n\r\n"):
        assert _c([wire]) == body and httptools_dechunk([wire]) == "error"
    # more than 15 hex digits: the C pass refuses them (its sizes are 64-bit), llhttp takes
    # leading zeros as long as the value fits
    wire = b"%016x\r\nhello\r\n0\r\n\r\n" % 5
    assert _c([wire]) == "error" and httptools_dechunk([wire]) == body


@pytest.mark.usefixtures("c_pass")
def test_reads_given_as_views_read_as_the_same_bytes() -> None:
    """The upstream connection hands on the body after a response head as a view of the read
    it came in: views, offset into a larger buffer, de-chunk as the same bytes do."""
    wire = _wire(PARTS, b"%x;e=1", b"x-trailer: 1\r\n")
    framed = b"HTTP/1.1 200 OK\r\n\r\n" + wire
    at = framed.index(wire)
    for cut in range(len(wire) + 1):
        views = [memoryview(framed)[at : at + cut], memoryview(framed)[at + cut :]]
        assert _c(views) == _c([wire[:cut], wire[cut:]]), cut  # type: ignore[list-item]
    assert _c([memoryview(b"?x\r\nabc\r\n")[1:]]) == "error"


_SIZES = st.sampled_from([b"%x", b"%X", b"%04x", b"%x;e=1", b'%x;a="b c";d', b"%015X"])
_TRAILERS = st.sampled_from([b"", b"x-t: 1\r\n", b"a: 1\r\nb-c: two words\r\n"])


@pytest.mark.usefixtures("c_pass")
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=40), min_size=0, max_size=8),
    _SIZES,
    _TRAILERS,
    st.data(),
)
def test_generated_chunked_bodies_cut_anywhere_give_what_llhttp_gives(
    parts: list[bytes], size: bytes, trailer: bytes, data: st.DataObject
) -> None:
    wire = _wire(parts, size, trailer)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=5)))
    edges = [0, *cuts, len(wire)]
    reads = [wire[a:b] for a, b in zip(edges, edges[1:], strict=False)]
    assert _c(reads) == httptools_dechunk(reads) == (b"".join(parts), True)  # type: ignore[arg-type]


@pytest.mark.usefixtures("c_pass")
@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=30), min_size=1, max_size=6),
    _SIZES,
    _TRAILERS,
    st.data(),
)
def test_changed_bytes_accepted_by_llhttp_give_the_same_body(
    parts: list[bytes], size: bytes, trailer: bytes, data: st.DataObject
) -> None:
    """Bytes changed anywhere: where llhttp still accepts, the C pass gives the same body and
    end; where the C pass refuses, llhttp refuses too (it is never the stricter one on a
    body, `test_where_the_c_pass_and_llhttp_differ` aside, which these sizes cannot reach)."""
    wire = bytearray(_wire(parts, size, trailer))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(wire) - 1))
        wire[at] = data.draw(st.sampled_from(b'\r\n0aF;x =\t"g'))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=3)))
    edges = [0, *cuts, len(wire)]
    reads = [bytes(wire[a:b]) for a, b in zip(edges, edges[1:], strict=False)]
    ref = httptools_dechunk(reads)
    if ref != "error":
        assert _c(reads) == ref  # type: ignore[arg-type]


@pytest.mark.usefixtures("stream_reader")
def test_upstream_reads_a_chunked_answer_whole_and_keeps_the_connection() -> None:
    """`Upstream` (on the C pass and on llhttp) reads any chunked body, extensions and
    trailers included, written in many small pieces (an error answer read with ``read``, as
    the proxy passes non-200 answers back), and reuses the connection after."""
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

    got, connections = asyncio.run(asyncio.wait_for(run(), 30))
    assert got == [(500, b"".join(PARTS)), (200, b"".join(PARTS))]
    assert connections == 1
