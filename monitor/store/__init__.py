"""History store: SQLAlchemy models, Alembic migrations and the repository the API uses."""

from timwatch.monitor.store.db import describe_url, is_sqlite, make_engine, upgrade
from timwatch.monitor.store.models import METRIC_COLUMNS
from timwatch.monitor.store.repo import Store, StoreUnavailable, flatten_row

__all__ = [
    "METRIC_COLUMNS",
    "Store",
    "StoreUnavailable",
    "describe_url",
    "flatten_row",
    "is_sqlite",
    "make_engine",
    "upgrade",
]
