"""Engine creation (SQLite pragmas, PostgreSQL pool) and Alembic migrations run in code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

__all__ = ["describe_url", "is_sqlite", "make_engine", "upgrade"]

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

#: seconds a writer waits on a locked SQLite file before the API answers 503
SQLITE_BUSY_TIMEOUT_S = 5.0


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def describe_url(url: str) -> str:
    """The URL as safe to print: password hidden, SQLite path made absolute."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        return f"sqlite:///{Path(u.database).resolve()} (WAL)"
    return u.render_as_string(hide_password=True)


def make_engine(url: str, *, sqlite_synchronous: str = "FULL", **kwargs: Any) -> Engine:
    """An engine for ``url``.

    SQLite gets WAL (readers never block the single writer), ``synchronous=FULL`` (a commit is
    on disk before the API answers 200, so even power loss keeps it; NORMAL would only survive a
    process crash and saved under a millisecond per batch in our measurement) and
    ``BEGIN IMMEDIATE`` on write transactions (``execution_options(timwatch_write=True)``) so
    a writer takes the lock up front instead of failing on upgrade from a read lock.
    """
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            u,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
            **kwargs,
        )
        sync = sqlite_synchronous.upper()
        if sync not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"sqlite_synchronous must be OFF/NORMAL/FULL/EXTRA, got {sync!r}")

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={sync}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            # writers (engines made with execution_options(timwatch_write=True)) lock up front;
            # readers keep a deferred BEGIN so WAL lets them run beside the writer
            write = conn.get_execution_options().get("timwatch_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 10)
    return create_engine(u, **kwargs)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision`` with Alembic, configured in code (no alembic.ini)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
