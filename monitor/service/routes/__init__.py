"""The API's routers, one module per area; `create_app` includes `ROUTERS` in this order."""

from __future__ import annotations

from fastapi import APIRouter

from . import compare, diagnosis, history, ingest, masks, ops, report

__all__ = ["ROUTERS"]

ROUTERS: tuple[APIRouter, ...] = (
    ingest.router, masks.router, history.router, diagnosis.router, compare.router, report.router,
    ops.router,
)  # fmt: skip
