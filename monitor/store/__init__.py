"""History store: SQLAlchemy models, Alembic migrations and the repository the API uses."""

from .db import describe_url, is_sqlite, make_engine, upgrade
from .models import METRIC_COLUMNS
from .repo import Store, StoreUnavailable, flatten_row

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
