"""``timwatch serve``: checks the settings, binds the port, opens the store, runs uvicorn.

Every check that can fail on the user's input runs before the startup line is printed, cheapest
first (port range, bind/token combination, database URL, then the socket, then the store), so a
mistake costs no kernel warm-up and never leaves a half-started server or an empty database.
"""

from __future__ import annotations

import errno
import socket
import sys
from typing import TYPE_CHECKING, TextIO

from ..core.errors import ConfigError, InsecureBindError, StoreUnavailable
from .settings import Settings, is_loopback

if TYPE_CHECKING:
    from ..store import Store

__all__ = [
    "InsecureBindError",
    "bind_socket",
    "check_bind",
    "check_settings",
    "open_store",
    "run_server",
    "startup_line",
]

#: how many ports above a busy one are tried for the "try --port N" hint
_PORT_HINT_SPAN = 20


def check_bind(settings: Settings) -> None:
    """Refuse to expose unauthenticated writes beyond this machine unless told to."""
    if not is_loopback(settings.host) and not settings.token and not settings.insecure:
        raise InsecureBindError(
            f"refusing to listen on {settings.host} without a write token: anyone who can reach "
            "it could write history. Set TIMWATCH_TOKEN (or --token), or pass --insecure."
        )


def check_settings(settings: Settings) -> None:
    """The checks that need neither the network nor the store: port range, bind/token, the
    database URL (parsable, driver installed, SQLite directory writable). The store's
    libraries load only for the last check, so the others refuse at once."""
    if not 1 <= settings.port <= 65535:
        raise ConfigError(f"port must be 1–65535, got {settings.port}")
    if settings.nonfinite not in ("refuse", "drop"):
        raise ConfigError(f"nonfinite must be 'refuse' or 'drop', got {settings.nonfinite!r}")
    if settings.max_body <= 0:
        raise ConfigError(f"--max-body must be positive, got {settings.max_body}")
    if settings.inflight_budget < settings.max_body:
        raise ConfigError(
            f"--max-inflight ({settings.inflight_budget}) must be at least --max-body "
            f"({settings.max_body}): a largest body could never be admitted"
        )
    check_bind(settings)
    from ..store.db import check_url

    check_url(settings.db_url)


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # lets a restart reuse a port whose old connections sit in TIME_WAIT; a port another
        # process listens on still refuses the bind
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except BaseException:
        sock.close()
        raise
    return sock


def _free_port_near(host: str, port: int) -> int | None:
    for candidate in range(port + 1, min(port + _PORT_HINT_SPAN, 65535) + 1):
        try:
            _listening_socket(host, candidate).close()
        except OSError:
            continue
        return candidate
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), or a `ConfigError` naming the fix (a busy port gets the
    next free one as a hint). uvicorn serves on this socket, so the port cannot be taken
    between this check and serving."""
    try:
        sock = _listening_socket(host, port)
    except socket.gaierror:
        raise ConfigError(
            f"cannot resolve --host {host}: use an address such as 127.0.0.1"
        ) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            near = _free_port_near(host, port)
            hint = f": try --port {near}" if near else ""
            raise ConfigError(f"port {port} is in use{hint}") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"port {port} needs privileges here: try --port 8000") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"cannot listen on {host}: it is not an address of this machine"
            ) from None
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def open_store(url: str) -> Store:
    """Open and migrate the store; a failure becomes one line naming the database."""
    from sqlalchemy.exc import DBAPIError

    from ..store import Store, describe_url, is_sqlite

    where = describe_url(url)
    verb = "cannot open" if is_sqlite(url) else "cannot connect to"
    try:
        return Store(url)
    except StoreUnavailable as exc:
        raise StoreUnavailable(f"{verb} {where}: {exc}") from exc
    except DBAPIError as exc:
        first = str(exc.orig or exc).strip().splitlines() or [type(exc).__name__]
        raise ConfigError(f"{verb} {where}: {first[0]}") from exc


def startup_line(settings: Settings, store_description: str) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    writes = "protected by bearer token" if settings.writes_protected else "OPEN (no token)"
    reads = "protected by read token" if settings.reads_protected else "open"
    return (
        f"timwatch listening on http://{host}:{settings.port} · store {store_description} · "
        f"writes {writes} · reads {reads}"
    )


def run_server(settings: Settings, *, log_level: str = "info", out: TextIO = sys.stdout) -> None:
    """Check, bind, open (and migrate) the store, print the startup line, serve until
    interrupted. Raises `ConfigError`, `InsecureBindError` or `StoreUnavailable` before the
    startup line when something cannot work."""
    check_settings(settings)
    sock = bind_socket(settings.host, settings.port)
    try:
        import uvicorn

        from ..core.engine import warm_up

        store = open_store(settings.db_url)  # a store that cannot open fails before the rest loads
        warm_up()
        from .app import create_app

        app = create_app(settings, store=store)
        print(startup_line(settings, store.description), file=out, flush=True)
        config = uvicorn.Config(
            app,
            log_level=log_level,
            access_log=log_level == "debug",
            timeout_graceful_shutdown=5,
        )
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
