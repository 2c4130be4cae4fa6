"""The service app in this process: ``create_app(settings, store=Store(url))`` with its ASGI
lifespan running on a private event loop, reached through ordinary synchronous ``httpx.Client``s.

No socket and no uvicorn: requests go straight into the ASGI app (``httpx.ASGITransport``), whose
exceptions propagate to the test instead of becoming a 500. The lifespan is driven over the ASGI
protocol, so the store is closed exactly as ``timwatch serve`` closes it. Behaviour that needs a
process (kill -9, bind refusal, bytes over a real socket) belongs to `tests.helpers.procs`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import httpx
from anyio.from_thread import BlockingPortal, start_blocking_portal

from timwatch.monitor import Settings, Store, create_app
from timwatch.monitor.core.clock import SYSTEM_CLOCK, Clock

__all__ = ["BASE_URL", "InProcessApp", "in_process"]

BASE_URL = "http://testserver"

Message = dict[str, Any]


class _Chunks(httpx.AsyncByteStream):
    """A request body already read from the sync side, replayed chunk by chunk."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


class _PortalTransport(httpx.BaseTransport):
    """Sync transport: each request runs through ``httpx.ASGITransport`` on the portal's loop."""

    def __init__(self, portal: BlockingPortal, app: Any) -> None:
        self.portal = portal
        self.asgi = httpx.ASGITransport(app=app)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        chunks = [bytes(c) for c in request.stream]  # type: ignore[union-attr]
        forwarded = httpx.Request(
            request.method, request.url, headers=request.headers, stream=_Chunks(chunks)
        )

        async def go() -> tuple[int, list[tuple[bytes, bytes]], bytes]:
            response = await self.asgi.handle_async_request(forwarded)
            raw = b"".join([part async for part in response.stream])  # type: ignore[union-attr]
            return response.status_code, response.headers.raw, raw

        status, headers, body = self.portal.call(go)
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))


@asynccontextmanager
async def _lifespan(app: Any) -> AsyncIterator[None]:
    """Startup before the body, shutdown after it, both over the ASGI lifespan protocol."""
    to_app_send, to_app = anyio.create_memory_object_stream[Message](2)
    from_app_send, from_app = anyio.create_memory_object_stream[Message](2)
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}

    async def expect(kind: str) -> None:
        message = await from_app.receive()
        if message["type"] != f"{kind}.complete":
            raise RuntimeError(f"{kind} failed: {message.get('message', message)}")

    async with anyio.create_task_group() as tg, to_app_send, from_app:
        tg.start_soon(app, scope, to_app.receive, from_app_send.send)
        await to_app_send.send({"type": "lifespan.startup"})
        await expect("lifespan.startup")
        try:
            yield
        finally:
            await to_app_send.send({"type": "lifespan.shutdown"})
            await expect("lifespan.shutdown")


class InProcessApp:
    """A running app: `store` is the real store it writes to, `client()` talks to it."""

    def __init__(self, portal: BlockingPortal, app: Any, settings: Settings, store: Store) -> None:
        self.portal, self.app, self.settings, self.store = portal, app, settings, store

    def client(self, token: str | None = None) -> httpx.Client:
        """A client sending ``Authorization: Bearer TOKEN`` when a token is given."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        transport = _PortalTransport(self.portal, self.app)
        return httpx.Client(base_url=BASE_URL, headers=headers, transport=transport, timeout=60.0)


@contextmanager
def in_process(
    settings: Settings, *, store: Store | None = None, clock: Clock | None = None
) -> Iterator[InProcessApp]:
    """``create_app(settings, store=store or Store(settings.db_url), clock=clock)`` (the system
    clock when None), lifespan running until the block exits (which closes the store)."""
    store = store if store is not None else Store(settings.db_url)
    app = create_app(settings, store=store, clock=clock or SYSTEM_CLOCK)
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(_lifespan(app)):
        yield InProcessApp(portal, app, settings, store)
