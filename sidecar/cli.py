"""``timwatch sidecar ...`` commands (mounted by ``monitor/cli.py`` as the ``sidecar`` group)."""

from __future__ import annotations

import typer

__all__ = ["sidecar_app"]

sidecar_app = typer.Typer(help="Collectors that feed timwatch: engine proxies and adapters.")


@sidecar_app.callback()
def _group() -> None:
    """Collectors that feed timwatch: engine proxies and adapters."""


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise typer.BadParameter(f"--listen must be HOST:PORT, got {listen!r}")
    return host or "127.0.0.1", int(port)


@sidecar_app.command("sglang")
def sglang(
    upstream: str = typer.Option(..., "--upstream", help="SGLang server URL, e.g. http://h:30000"),
    listen: str = typer.Option("127.0.0.1:30010", "--listen", help="HOST:PORT to serve on"),
    monitor: str | None = typer.Option(None, "--monitor", help="timwatch service URL"),
    topk: int | None = typer.Option(
        None, "--topk", min=1, help="Request top-k logprobs to bound the rollout entropy"
    ),
    vocab_size: int | None = typer.Option(
        None, "--vocab-size", min=1, help="Vocabulary size (enables the top-k tail bound)"
    ),
    probe_rate: float = typer.Option(
        0.0, "--probe-rate", min=0.0, max=1.0, help="Fraction of samples re-scored by prefill"
    ),
    timeout_s: float | None = typer.Option(
        None, "--timeout", help="Upstream timeout in seconds (default: wait as long as clients)"
    ),
    ttl_s: float = typer.Option(900.0, "--ttl", help="Seconds an unjoined record is kept"),
) -> None:
    """Reverse proxy in front of SGLang that captures μ, ids and versions per sample."""
    import uvicorn

    from sidecar.sglang_proxy import create_app

    host, port = _split_listen(listen)
    app = create_app(
        upstream,
        monitor=monitor,
        topk=topk,
        probe_rate=probe_rate,
        vocab_size=vocab_size,
        timeout_s=timeout_s,
        ttl_s=ttl_s,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
