"""The raw relay (`proxy.http.relay.RawStream`) writes through uvicorn's httptools request cycle,
which is not a public API: pyproject pins uvicorn to the minor versions it was tested on
(`relay.UVICORN_TESTED`). These tests fail when the installed uvicorn leaves that range, when
the pin and the tested range disagree, or when the cycle no longer has what the relay uses
(then `uvicorn_cycle` must be updated and the relay tested again on the new version)."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from importlib.metadata import version
from pathlib import Path

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.helpers.procs import free_port
from timwatch.sidecar.proxy.http.relay import (
    CYCLE_ATTRIBUTES,
    UVICORN_TESTED,
    ProxyApp,
    uvicorn_cycle,
)

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_installed_uvicorn_is_the_tested_one_and_the_pin_says_so() -> None:
    major, minor = (int(x) for x in version("uvicorn").split(".")[:2])
    assert (major, minor) == UVICORN_TESTED, version("uvicorn")
    proxy = re.search(r"^proxy = \[(.*?)^\]", PYPROJECT.read_text(), re.S | re.M)
    assert proxy is not None
    found = re.findall(r'"uvicorn([^"]*)"', proxy.group(1))
    assert found == [f">={major}.{minor},<{major}.{minor + 1}"], proxy


def test_the_request_cycle_has_what_the_raw_relay_uses() -> None:
    """A real uvicorn (httptools) serving a `ProxyApp`: `uvicorn_cycle` finds the cycle behind
    a request's scope, and it has every attribute the relay reads."""

    async def probe(request: Request) -> Response:
        cycle = uvicorn_cycle(request.scope)
        return JSONResponse(
            {
                "found": cycle is not None,
                "missing": [a for a in CYCLE_ATTRIBUTES if not hasattr(cycle, a)],
                "drain": callable(getattr(getattr(cycle, "flow", None), "drain", None)),
            }
        )

    port = free_port()
    app = ProxyApp(routes=[Route("/probe", probe)])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            thread.join(0.05)
        assert server.started
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /probe HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
            answer = b""
            while more := sock.recv(65536):
                answer += more
    finally:
        server.should_exit = True
        thread.join(10)
    assert answer.startswith(b"HTTP/1.1 200")
    assert answer.endswith(b'{"found":true,"missing":[],"drain":true}'), answer
