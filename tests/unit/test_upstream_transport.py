"""The `/generate` upstream client takes any transport with asyncio's methods: uvloop's (which
uvicorn uses when it is installed, e.g. with ``uvicorn[standard]``) are not subclasses of
``asyncio.Transport``, and an isinstance assertion turned every planned request into a 500."""

from __future__ import annotations

import asyncio

from timwatch.sidecar.proxy.http.client import Upstream, _Conn


class _DuckTransport:
    """Has what `_Conn` calls, is no ``asyncio.Transport`` (as uvloop's ``TCPTransport``)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def test_a_transport_that_is_no_asyncio_transport_is_kept() -> None:
    transport = _DuckTransport()
    assert not isinstance(transport, asyncio.Transport)
    conn = _Conn(Upstream("http://127.0.0.1:1", timeout_s=1))
    conn.connection_made(transport)  # type: ignore[arg-type]
    assert conn.transport is transport
    conn.close()
    assert transport.closed and conn.lost
