"""Throw-away PostgreSQL databases on the server of ``TIMWATCH_TEST_PG_URL``.

With ``CI`` or ``TIMWATCH_REQUIRE_PG`` set, a missing URL fails the test instead of skipping it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

__all__ = ["fresh_database", "pg_base_url"]


def pg_base_url() -> str:
    url = os.environ.get("TIMWATCH_TEST_PG_URL")
    if url:
        return url
    if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_PG"):
        pytest.fail("CI is set but TIMWATCH_TEST_PG_URL is not: PostgreSQL tests must run in CI")
    pytest.skip("TIMWATCH_TEST_PG_URL not set (bash .ci/start-postgres.sh prints one)")


@contextmanager
def fresh_database(prefix: str = "tw", base: str | None = None) -> Iterator[str]:
    """The URL of a new, empty database on `base` (default the tests' server), dropped
    (connections and all) on exit."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    base = base or pg_base_url()
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
