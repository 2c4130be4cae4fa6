"""``timwatch serve``: the service's command line (checks, store, uvicorn)."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from ..core.masks import PolicyParams
from ..service.settings import (
    DEFAULT_DB_URL,
    DEFAULT_FINISH_GRACE,
    DEFAULT_MAX_BODY,
    DEFAULT_RUN_TTL,
)
from .params import check_nonfinite, with_policy_options

__all__ = ["check_replica_id", "serve"]

_REPLICA_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_replica_id(value: str | None) -> str | None:
    """``--replica-id``: None or 1-128 characters of [A-Za-z0-9._:-] (a pod or service name)."""
    if value is not None and not _REPLICA_ID.fullmatch(value):
        raise typer.BadParameter("use 1-128 characters of [A-Za-z0-9._:-]")
    return value


@with_policy_options
def serve(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind (1–65535)")] = 8000,
    db: Annotated[
        str,
        typer.Option(
            envvar="TIMWATCH_DB",
            help="history store: sqlite:///PATH or postgresql+psycopg://USER@HOST/DB",
        ),
    ] = DEFAULT_DB_URL,
    token: Annotated[
        str | None,
        typer.Option(envvar="TIMWATCH_TOKEN", help="bearer token for writes", show_default=False),
    ] = None,
    read_token: Annotated[
        str | None,
        typer.Option(
            envvar="TIMWATCH_READ_TOKEN", help="bearer token for reads", show_default=False
        ),
    ] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="allow a non-loopback bind without a write token")
    ] = False,
    max_body: Annotated[int, typer.Option(help="largest request body, bytes")] = DEFAULT_MAX_BODY,
    max_inflight: Annotated[
        int | None,
        typer.Option(
            help="request-body bytes read or processed at once, server-wide (more: 503); "
            "default 4 × --max-body",
            show_default=False,
        ),
    ] = None,
    run_ttl: Annotated[
        float,
        typer.Option(help="seconds an idle, unfinished run stays in /metrics (stall alerts)"),
    ] = DEFAULT_RUN_TTL,
    finish_grace: Annotated[
        float, typer.Option(help="seconds a finished run stays in /metrics (timwatch finish)")
    ] = DEFAULT_FINISH_GRACE,
    nonfinite: Annotated[
        str, typer.Option(help="refuse: 422 on NaN/inf; drop: mask and count such tokens")
    ] = "refuse",
    tokenizer: Annotated[
        str | None,
        typer.Option(
            envvar="TIMWATCH_TOKENIZER",
            metavar="FILE",
            help="a Hugging Face tokenizer.json: the incident report shows the worst tokens' "
            "text, not only their ids",
            show_default=False,
        ),
    ] = None,
    replica_id: Annotated[
        str | None,
        typer.Option(
            envvar="TIMWATCH_REPLICA_ID",
            metavar="ID",
            callback=check_replica_id,
            help="this replica's stable name (1-128 of [A-Za-z0-9._:-]): its counters are "
            "kept in the store under it, in each batch's transaction, and continue after a "
            "restart with the same id; unset, they restart at 0 with the process. Give every "
            "running replica its own id",
            show_default=False,
        ),
    ] = None,
    page_severity: Annotated[
        str,
        typer.Option(
            envvar="TIMWATCH_PAGE_SEVERITY",
            help="the severity label of the Alertmanager alerts (POST /v1/alertmanager) that "
            "page a run for the guard (Tap on_page)",
        ),
    ] = "page",
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    *,
    params: PolicyParams,
) -> None:
    """Run the timwatch service (ingest, masks, history, /metrics)."""
    from ..service.serve import run_server
    from ..service.settings import Settings

    settings = Settings(
        host=host, port=port, db_url=db, token=token or None, read_token=read_token or None,
        max_body=max_body, max_inflight=max_inflight, run_ttl=run_ttl, finish_grace=finish_grace,
        nonfinite=check_nonfinite(nonfinite), params=params, insecure=insecure,
        tokenizer=tokenizer or None, replica_id=replica_id, page_severity=page_severity,
    )  # fmt: skip
    run_server(settings, log_level=log_level)
