"""Alembic environment: runs on the connection ``timwatch.monitor.store.db.upgrade`` hands over."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from timwatch.monitor.store.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:  # plain `alembic` command line with sqlalchemy.url set
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
        with engine.begin() as conn:
            _run(conn)
        return
    _run(connection)


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # type: ignore[attr-defined]
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations_online()
