"""``timwatch sidecar ...`` commands (mounted by ``monitor/cli.py`` as the ``sidecar`` group)."""

from __future__ import annotations

from typing import Any

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


# Options both proxy commands take, written once.
_TOKEN = typer.Option(
    None,
    "--token",
    envvar="TIMWATCH_TOKEN",
    help="The monitor's bearer token for writes",
    show_default=False,
)
_TIMEOUT = typer.Option(
    None, "--timeout", help="Upstream timeout in seconds (default: wait as long as clients)"
)
_TTL = typer.Option(900.0, "--ttl", help="Seconds an unjoined record is kept")
_MAX_HELD_BYTES = typer.Option(
    2 << 30,
    "--max-held-bytes",
    min=1,
    help="Bytes of unjoined records held at most; the oldest are dropped first (counted)",
)
_REPORT_TTL = typer.Option(
    60.0, "--report-ttl", help="Seconds a trainer report waits for its rollout records"
)

_PEERS = typer.Option(
    None,
    "--peer",
    help="URL of another proxy behind the same router (repeat it; needs --monitor): report "
    "samples this proxy does not hold are taken from the peers",
    show_default=False,
)


def _check_runs(run: str, *derived: str) -> None:
    """Refuse a --run the monitor would refuse every batch of; with ``derived`` (runs named
    after it) those are checked too and the message names the one that failed."""
    from ..monitor.core.runid import check_run_id

    for name in (run, *derived):
        reason = check_run_id(name)
        if reason is not None:
            checked = f" (checked {name!r})" if derived else ""
            raise typer.BadParameter(f"--run {run!r}: {reason}{checked}")


def _serve(app: Any, host: str, port: int, banner: str, monitor: str | None, run: str) -> None:
    """Print where the proxy listens and serve ``app`` until interrupted."""
    import uvicorn

    typer.echo(
        f"timwatch sidecar listening on http://{host}:{port} → {banner}"
        + (f" · monitor {monitor} (run {run!r})" if monitor else " · capture only (no --monitor)")
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


@sidecar_app.command("sglang")
def sglang(
    upstream: str = typer.Option(..., "--upstream", help="SGLang server URL, e.g. http://h:30000"),
    listen: str = typer.Option("127.0.0.1:30010", "--listen", help="HOST:PORT to serve on"),
    monitor: str | None = typer.Option(
        None,
        "--monitor",
        help="timwatch service URL: enables trainer reports and prefill-probe forwarding",
    ),
    run: str = typer.Option(
        "default", "--run", help="Run for joined batches (probes go to <run>-prefill-probe)"
    ),
    token: str | None = _TOKEN,
    topk: int | None = typer.Option(
        None, "--topk", min=1, help="Request top-k logprobs to bound the rollout entropy"
    ),
    vocab_size: int | None = typer.Option(
        None, "--vocab-size", min=1, help="Vocabulary size (enables the top-k tail bound)"
    ),
    probe_rate: float = typer.Option(
        0.0, "--probe-rate", min=0.0, max=1.0, help="Fraction of samples re-scored by prefill"
    ),
    timeout_s: float | None = _TIMEOUT,
    ttl_s: float = _TTL,
    max_held_bytes: int = _MAX_HELD_BYTES,
    report_ttl_s: float = _REPORT_TTL,
    probe_batch: int = typer.Option(
        64, "--probe-batch", min=1, help="Probe results per batch sent to the monitor"
    ),
    probe_flush_s: float = typer.Option(
        10.0, "--probe-flush", min=0.01, help="Seconds before a partial probe batch is sent"
    ),
    peers: list[str] | None = _PEERS,
    peer_timeout_s: float = typer.Option(
        5.0, "--peer-timeout", min=0.01, help="Seconds one take request to a peer may last"
    ),
) -> None:
    """Reverse proxy in front of SGLang that captures μ, ids and versions per sample.

    With --monitor it also accepts trainer reports on POST /timwatch/v1/trainer_reports (joined
    batches go to run --run) and, with --probe-rate > 0, sends decode-vs-prefill probes to run
    <run>-prefill-probe. With --peer, N proxies behind one router join every report wherever
    its samples were captured.
    """
    from .proxy.join.http import install_join
    from .proxy.sglang.app import create_app
    from .proxy.sglang.probe_forward import PROBE_RUN_SUFFIX, install_probe_forward

    host, port = _split_listen(listen)
    _check_runs(run, run + PROBE_RUN_SUFFIX)
    if peers and not monitor:
        raise typer.BadParameter("--peer needs --monitor (peers join trainer reports)")
    app = create_app(
        upstream,
        topk=topk,
        probe_rate=probe_rate,
        vocab_size=vocab_size,
        timeout_s=timeout_s,
        ttl_s=ttl_s,
        max_held_bytes=max_held_bytes,
    )
    if monitor:
        install_join(
            app,
            monitor=monitor,
            run=run,
            token=token,
            report_ttl_s=report_ttl_s,
            peers=peers or (),
            peer_timeout_s=peer_timeout_s,
            self_url=f"http://{host}:{port}",
        )
        if probe_rate > 0.0:
            install_probe_forward(
                app,
                monitor=monitor,
                run=run,
                token=token,
                batch_size=probe_batch,
                flush_s=probe_flush_s,
            )
    _serve(app, host, port, f"SGLang {upstream}", monitor, run)


@sidecar_app.command("vllm")
def vllm(
    upstream: str = typer.Option(
        ..., "--upstream", help="vLLM OpenAI-compatible server URL, e.g. http://h:8000"
    ),
    listen: str = typer.Option("127.0.0.1:8010", "--listen", help="HOST:PORT to serve on"),
    monitor: str | None = typer.Option(
        None, "--monitor", help="timwatch service URL: enables trainer reports"
    ),
    run: str = typer.Option("default", "--run", help="Run for joined batches"),
    token: str | None = _TOKEN,
    logprobs_mode: str = typer.Option(
        "raw_logprobs",
        "--logprobs-mode",
        help="The engine's --logprobs-mode: raw_logprobs (vLLM's default) or processed_logprobs",
    ),
    timeout_s: float | None = _TIMEOUT,
    ttl_s: float = _TTL,
    max_held_bytes: int = _MAX_HELD_BYTES,
    report_ttl_s: float = _REPORT_TTL,
) -> None:
    """Reverse proxy in front of vLLM that captures μ, ids, versions and sampling parameters.

    Captures /v1/completions, /v1/chat/completions and /inference/v1/generate, streamed or not;
    clients get vLLM's own bytes for their request. With --monitor it also accepts trainer
    reports on POST /timwatch/v1/trainer_reports (joined batches go to run --run).
    """
    from .proxy.join.http import install_join
    from .proxy.vllm.app import LOGPROBS_MODES, create_app

    host, port = _split_listen(listen)
    if logprobs_mode not in LOGPROBS_MODES:
        raise typer.BadParameter(
            f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}"
        )
    _check_runs(run)
    app = create_app(
        upstream,
        logprobs_mode=logprobs_mode,
        timeout_s=timeout_s,
        ttl_s=ttl_s,
        max_held_bytes=max_held_bytes,
    )
    if monitor:
        install_join(app, monitor=monitor, run=run, token=token, report_ttl_s=report_ttl_s)
    _serve(app, host, port, f"vLLM {upstream} ({logprobs_mode})", monitor, run)
