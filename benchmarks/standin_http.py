"""What the engine stand-ins (`sglang_standin.py`, `vllm_standin.py`) share: cached byte runs
and a minimal HTTP/1.1 keep-alive server on plain asyncio streams and httptools.

``serve`` reads one request at a time per connection and hands it to ``handle``, which writes
the whole answer; a closed connection or a request httptools cannot parse ends the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httptools


class Joined:
    """Items joined by commas once; any run of them is then one slice (a memcpy)."""

    def __init__(self, items: list[bytes]) -> None:
        self.data = b",".join(items)
        self.starts = [0]
        for item in items:
            self.starts.append(self.starts[-1] + len(item) + 1)

    def run(self, lo: int, hi: int) -> bytes:
        return self.data[self.starts[lo] : self.starts[hi] - 1] if hi > lo else b""


class HttpRequest:
    """One parsed request: URL, lower-cased header names, body."""

    def __init__(self) -> None:
        self.url = b""
        self.body = bytearray()
        self.headers: dict[bytes, bytes] = {}
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


Handler = Callable[[HttpRequest, asyncio.StreamWriter], Awaitable[None]]


async def _connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: Handler
) -> None:
    try:
        while True:
            req = HttpRequest()
            parser = httptools.HttpRequestParser(req)
            while not req.done:
                data = await reader.read(65536)
                if not data:
                    return
                parser.feed_data(data)
            await handle(req, writer)
    except (ConnectionError, httptools.HttpParserError):
        pass
    finally:
        writer.close()


def serve(port: int, handle: Handler) -> None:
    """Serve on 127.0.0.1:``port`` until interrupted."""

    async def run() -> None:
        server = await asyncio.start_server(
            lambda r, w: _connection(r, w, handle), "127.0.0.1", port, backlog=4096
        )
        async with server:
            await server.serve_forever()

    asyncio.run(run())
