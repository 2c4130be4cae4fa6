"""Engine creation (SQLite pragmas, PostgreSQL pool) and Alembic migrations run in code."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from ..core.errors import ConfigError

__all__ = [
    "PG_LOCK_TIMEOUT_S",
    "SQLITE_BUSY_TIMEOUT_S",
    "check_url",
    "describe_url",
    "is_sqlite",
    "make_engine",
    "upgrade",
]

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

#: seconds a writer waits on a locked SQLite file before the API answers 503 (after at most
#: ``health.WRITE_LOCK_TIMEOUT_S`` in the in-process queue: 1 s in all)
SQLITE_BUSY_TIMEOUT_S = 0.5
#: seconds a PostgreSQL statement waits for a row or table lock before the API answers 503
PG_LOCK_TIMEOUT_S = 1.0
#: the advisory lock key that serialises migrations of one PostgreSQL database ("timwatch")
MIGRATION_LOCK_KEY = 0x74696D7761746368
MIGRATION_LOCK_TIMEOUT_S = 120
#: seconds a PostgreSQL caller waits for a pooled connection before the API answers 503
PG_POOL_TIMEOUT_S = 2.0


POSTGRES_HINT = "postgresql+psycopg://USER:PASSWORD@HOST:5432/DB"


def _parse(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError:
        if "://" not in url:
            raise ConfigError(f"{url!r} is not a database URL: use sqlite:///{url}") from None
        raise ConfigError(
            f"cannot parse database URL {url!r}: use sqlite:///PATH or {POSTGRES_HINT}"
        ) from None


def check_url(url: str) -> URL:
    """The parsed URL, or a `ConfigError` saying how to fix it: unparsable, an unknown
    database, a driver that is not installed, or a SQLite file that cannot be created or
    written (its directory must exist; nothing is created here)."""
    u = _parse(url)
    shown = u.render_as_string(hide_password=True)
    try:
        dialect = u.get_dialect()
    except NoSuchModuleError:
        raise ConfigError(
            f"unknown database {u.drivername!r} in {shown}: use sqlite:///PATH or {POSTGRES_HINT}"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise ConfigError(_driver_hint(u, shown, exc)) from None
    if u.get_backend_name() == "sqlite":
        _check_sqlite_file(u.database)
    return u


def _driver_hint(u: URL, shown: str, exc: ImportError) -> str:
    if u.get_backend_name() != "postgresql":
        return (
            f"{shown} needs the {exc.name or u.get_driver_name()} module, which is not installed;"
            f" timwatch supports sqlite:///PATH and {POSTGRES_HINT}"
        )
    if "+" not in u.drivername or u.get_driver_name() != "psycopg":
        fixed = u.set(drivername="postgresql+psycopg").render_as_string(hide_password=True)
        return (
            f"{shown} asks for the {u.get_driver_name()} driver, which is not installed: "
            f"write {fixed} (pip install 'timwatch[postgres]')"
        )
    return f"the psycopg driver for {shown} is not installed: pip install 'timwatch[postgres]'"


def _check_sqlite_file(database: str | None) -> None:
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database).expanduser().resolve()
    parent = path.parent
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: name a file, e.g. sqlite:///{path}/timwatch.db")
    if not parent.exists():
        raise ConfigError(
            f"cannot create the SQLite database {path}: directory {parent} does not exist "
            "(create it or choose another path)"
        )
    if not parent.is_dir():
        raise ConfigError(f"cannot create the SQLite database {path}: {parent} is not a directory")
    # WAL keeps -wal and -shm files beside the database, so the directory must be writable too.
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"cannot write the SQLite database {path}: directory {parent} is not writable "
            "(choose a writable path)"
        )
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise ConfigError(
            f"cannot write the SQLite database {path}: permission denied (choose a writable path)"
        )


def is_sqlite(url: str) -> bool:
    return _parse(url).get_backend_name() == "sqlite"


def describe_url(url: str) -> str:
    """The URL as safe to print: password hidden, SQLite path made absolute."""
    u = _parse(url)
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
    PostgreSQL gets ``lock_timeout`` = `PG_LOCK_TIMEOUT_S` on every connection, so a row or
    table lock held elsewhere fails the statement (503) instead of hanging the request.
    A URL that cannot work raises `ConfigError` first (`check_url`).
    """
    u = check_url(url)
    if u.get_backend_name() == "sqlite":
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
    # 10 + 24 connections: every ingest the service admits at once (INGEST_SLOTS) has one
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 24)
    kwargs.setdefault("pool_timeout", PG_POOL_TIMEOUT_S)
    connect_args = dict(kwargs.pop("connect_args", {}))
    options = connect_args.get("options", "")
    connect_args["options"] = f"{options} -c lock_timeout={int(PG_LOCK_TIMEOUT_S * 1000)}".strip()
    return create_engine(u, connect_args=connect_args, **kwargs)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision`` with Alembic, configured in code (no alembic.ini)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Replicas starting together on a fresh database would race to create the same
            # tables; one transaction-scoped advisory lock lets one migrate while the others wait
            # (past the 1 s lock_timeout) and then find the schema at head.
            conn.execute(text(f"SET LOCAL lock_timeout = '{MIGRATION_LOCK_TIMEOUT_S}s'"))
            conn.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
