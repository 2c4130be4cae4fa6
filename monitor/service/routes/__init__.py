"""The API's routers, one module per area; `create_app` includes `ROUTERS` in this order."""

from __future__ import annotations

from fastapi import APIRouter

from . import compare, diagnosis, guard, history, ingest, masks, ops, report, scalars

__all__ = ["ROUTERS"]

ROUTERS: tuple[APIRouter, ...] = (
    ingest.router, scalars.router, masks.router, history.router, diagnosis.router, compare.router,
    report.router, ops.router, guard.router,
)  # fmt: skip
