"""The timwatch service of `timwatch demo`: in this process, in a background thread, on a socket
it owns (so the port is known before the first request), storing history where ``--db`` says."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

__all__ = ["DemoService", "free_run_name"]


class DemoService:
    """The timwatch service in a background thread of this process, on a socket it owns."""

    def __init__(self, db_url: str, port: int = 0) -> None:
        import uvicorn

        from ...monitor.service.app import create_app
        from ...monitor.service.settings import Settings
        from ...monitor.store import Store

        self.store = Store(db_url)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = int(self.sock.getsockname()[1])
        settings = Settings(host="127.0.0.1", port=self.port, db_url=db_url)
        app = create_app(settings, store=self.store)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the demo's timwatch service did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        self.store.close()


def free_run_name(store: Any, run: str) -> str:
    """A run name not yet in the history (re-running the demo must not merge into old steps)."""
    if not store.run_exists(run):
        return run
    k = 2
    while store.run_exists(f"{run}-{k}"):
        k += 1
    return f"{run}-{k}"
