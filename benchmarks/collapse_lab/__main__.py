"""``python -m benchmarks.collapse_lab --config NAME[,NAME…] [--seeds 0,1,2] [--out DIR]``.

Each run: a `LabTrainer` reporting every step through the `Tap` to one real `timwatch serve`
subprocess (shared by the runs of one invocation, a fresh SQLite history under ``--out``), the
run's exported series read back from /metrics after each step, then replayed through the shipped
rules by promtool; the trainer's reward, gradient norm and entropy go to the same run as
scalars (`Tap.log`). Writes ``DIR/CONFIG-sSEED/{steps.jsonl,series.jsonl,result.json}``;
``python -m benchmarks.collapse_lab.report DIR`` makes the table and plots.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from benchmarks.collapse_lab.configs import CONFIGS, LabConfig, collapse_onset
from benchmarks.collapse_lab.replay import RULES, first_firings
from benchmarks.collapse_lab.serve import LabServer, snapshot

if TYPE_CHECKING:
    from benchmarks.collapse_lab.grpo import StepLog  # torch: imported by the runs only


def lead_summary(onset: int | None, firings: list[dict[str, Any]]) -> dict[str, Any]:
    """First page and first warning (any alert of that severity), and their lead over onset."""
    out: dict[str, Any] = {}
    for sev in ("page", "warning"):
        steps = [f["step"] for f in firings if f["severity"] == sev]
        first = min(steps) if steps else None
        out[f"first_{sev}"] = first
        out[f"lead_{sev}"] = None if first is None or onset is None else onset - first
    return out


def health_scalars(log: StepLog) -> dict[str, float]:
    """The step's trainer health under timwatch's canonical scalar names (`Tap.log`): read by
    no shipped rule, by the candidate rules (PROTOCOL-entropy.md)."""
    return {"reward_mean": log.reward, "grad_norm": log.grad_norm, "entropy": log.entropy}


def run_one(
    cfg: LabConfig,
    seed: int,
    server: LabServer,
    out: Path,
    progress: Progress,
    rules: Path = RULES,
    guard: bool = False,
) -> dict[str, Any]:
    from benchmarks.collapse_lab.grpo import LabTrainer
    from benchmarks.collapse_lab.guard import LabGuard
    from timwatch.sidecar.tap import RunPaged, Tap

    run = f"{cfg.name}-s{seed}"
    rundir = out / run
    rundir.mkdir(parents=True, exist_ok=True)
    trainer = LabTrainer(cfg, seed)
    task = progress.add_task(run, total=cfg.steps)
    logs, series = [], []
    started = time.monotonic()
    lab_guard = LabGuard(server.url, run, rules) if guard else None
    stopped = None
    with Tap(server.url, run, rank=0, on_page="raise" if guard else None) as tap:
        try:
            for step in range(cfg.steps):
                log = trainer.step(step, tap)
                tap.log(step, health_scalars(log))
                if not tap.flush(60):
                    raise RuntimeError(f"{run}: the tap could not deliver step {step}")
                logs.append(asdict(log))
                series.append(snapshot(server.metrics(), run))
                progress.update(task, advance=1, description=f"{run} reward {log.reward:.2f}")
                if lab_guard is not None:
                    lab_guard.after_step(step, series)
                tap.check_page(step)  # the step boundary: RunPaged once the service pages
        except RunPaged:
            stopped = step
    wall = time.monotonic() - started
    sent = len(logs) * cfg.prompts * cfg.group * cfg.prompt_len
    counted = series[-1].get(f'timwatch_token_kl_count{{run="{run}"}}') if series else None
    if counted != sent:  # e.g. another server shared the history and took some batches
        raise RuntimeError(f"{run}: sent {sent} tokens, the server exported {counted}")
    with open(rundir / "steps.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in logs)
    with open(rundir / "series.jsonl", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in series)
    onset = collapse_onset([r["reward"] for r in logs], [r["grad_norm"] for r in logs])
    firings = first_firings(series, rules=rules)
    result = {
        "config": cfg.name, "seed": seed, "steps": cfg.steps, "collapse_step": onset,
        "firings": firings, **lead_summary(onset, firings), "wall_s": round(wall, 1),
        "settings": asdict(cfg),
    }  # fmt: skip
    if lab_guard is not None:
        result["guard"] = {
            "paged_step": lab_guard.paged_step, "alerts": lab_guard.alerts, "stopped_step": stopped
        }  # fmt: skip
    (rundir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(
    config: Annotated[str, typer.Option(help=f"comma list of: {', '.join(CONFIGS)}")],
    seeds: Annotated[str, typer.Option("--seeds", "--seed", help="comma list of seeds")] = "0",
    out: Annotated[Path, typer.Option(help="output folder")] = Path("collapse-lab-runs"),
    steps: Annotated[int, typer.Option(help="override the steps per run (0: config's)")] = 0,
    rules: Annotated[Path, typer.Option(help="rules file to replay against")] = RULES,
    guard: Annotated[
        bool, typer.Option(help="stop each run at the step boundary after its first page")
    ] = False,
) -> None:
    """Run lab configurations through tap → timwatch serve → promtool-evaluated shipped rules."""
    names = [c.strip() for c in config.split(",") if c.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise typer.BadParameter(f"unknown config {', '.join(bad)}; known: {', '.join(CONFIGS)}")
    seed_list = [int(s) for s in seeds.split(",")]
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    # a SIGTERM unwinds like Ctrl-C, so the server subprocess is stopped below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = LabServer(out)
    try:
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console,
        ) as progress:  # fmt: skip
            for name in names:
                cfg = CONFIGS[name] if steps <= 0 else replace(CONFIGS[name], steps=steps)
                for seed in seed_list:
                    r = run_one(cfg, seed, server, out, progress, rules, guard)
                    fired = ", ".join(f"{f['alert']}@{f['step']}" for f in r["firings"])
                    progress.console.print(
                        f"{name} seed {seed}: collapse {r['collapse_step']} · "
                        f"fired: {fired or 'nothing'} · {r['wall_s']} s"
                    )
    finally:
        server.stop()


if __name__ == "__main__":
    typer.run(main)
