"""``timwatch serve``: checks the bind/token combination, opens the store, runs uvicorn."""

from __future__ import annotations

import sys
from typing import TextIO

from timwatch.monitor.core.errors import InsecureBindError
from timwatch.monitor.service.settings import Settings, is_loopback

__all__ = ["InsecureBindError", "check_bind", "run_server", "startup_line"]


def check_bind(settings: Settings) -> None:
    """Refuse to expose unauthenticated writes beyond this machine unless told to."""
    if not is_loopback(settings.host) and not settings.token and not settings.insecure:
        raise InsecureBindError(
            f"refusing to listen on {settings.host} without a write token: anyone who can reach "
            "it could write history. Set TIMWATCH_TOKEN (or --token), or pass --insecure."
        )


def startup_line(settings: Settings, store_description: str) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    writes = "protected by bearer token" if settings.writes_protected else "OPEN (no token)"
    reads = "protected by read token" if settings.reads_protected else "open"
    return (
        f"timwatch listening on http://{host}:{settings.port} · store {store_description} · "
        f"writes {writes} · reads {reads}"
    )


def run_server(settings: Settings, *, log_level: str = "info", out: TextIO = sys.stdout) -> None:
    """Open (and migrate) the store, print the startup line, serve until interrupted."""
    import uvicorn

    from timwatch.monitor.core.engine import warm_up
    from timwatch.monitor.service.app import create_app
    from timwatch.monitor.store import Store

    check_bind(settings)
    warm_up()
    store = Store(settings.db_url)
    app = create_app(settings, store=store)
    print(startup_line(settings, store.description), file=out, flush=True)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()
