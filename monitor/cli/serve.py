"""``timwatch serve``: the service's command line (checks, store, uvicorn)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from timwatch.monitor.service.settings import DEFAULT_DB_URL, DEFAULT_MAX_BODY, DEFAULT_RUN_TTL

__all__ = ["serve"]

console = Console(stderr=True)


def serve(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
    db: Annotated[
        str, typer.Option(help="SQLAlchemy URL: sqlite:///path or postgresql+psycopg://…")
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
        bool, typer.Option(help="allow a non-loopback bind without a write token")
    ] = False,
    max_body: Annotated[int, typer.Option(help="largest request body, bytes")] = DEFAULT_MAX_BODY,
    run_ttl: Annotated[
        float, typer.Option(help="seconds an idle run stays in /metrics")
    ] = DEFAULT_RUN_TTL,
    nonfinite: Annotated[
        str, typer.Option(help="refuse: 422 on NaN/inf; drop: mask and count such tokens")
    ] = "refuse",
    tau: Annotated[float, typer.Option(help="ESTR τ (1.6 math, 0.7 agentic)")] = 1.6,
    eps: Annotated[float, typer.Option(help="ESTR ε")] = 0.01,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Run the timwatch service (ingest, masks, history, /metrics)."""
    from timwatch.monitor.core.masks import PolicyParams
    from timwatch.monitor.service.serve import InsecureBindError, run_server
    from timwatch.monitor.service.settings import Settings

    if nonfinite not in ("refuse", "drop"):
        raise typer.BadParameter("--nonfinite must be 'refuse' or 'drop'")
    try:
        params = PolicyParams(tau=tau, eps=eps)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        raise typer.Exit(2) from None
    settings = Settings(
        host=host, port=port, db_url=db, token=token or None, read_token=read_token or None,
        max_body=max_body, run_ttl=run_ttl, nonfinite=nonfinite,  # type: ignore[arg-type]
        params=params, insecure=insecure,
    )  # fmt: skip
    try:
        run_server(settings, log_level=log_level)
    except InsecureBindError as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        raise typer.Exit(2) from None
