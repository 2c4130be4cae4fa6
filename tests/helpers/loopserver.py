"""A TCP server on asyncio streams in a thread of its own, for tests that must write exact
bytes as an upstream: a subclass answers in ``_serve``; `running` starts it, waits until it
listens, and stops it (connections still open are cancelled while the loop can close them)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from tests.helpers.procs import free_port


class LoopServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        self.ready.set()
        self.loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()


S = TypeVar("S", bound=LoopServer)


@contextmanager
def running(server: S) -> Iterator[S]:
    """``server`` listening inside the block, stopped after it."""
    server.thread.start()
    assert server.ready.wait(10), "the test server did not start listening"
    try:
        yield server
    finally:
        server.loop.call_soon_threadsafe(server.loop.stop)
        server.thread.join(10)
