"""``python -m benchmarks.collapse_lab.v2 --config NAME[,NAME…] [--seeds 0,1] [--out DIR]``.

Each run: a `V2Trainer` reporting every step through the `Tap` to one real `timwatch serve`
subprocess (lab v1's `LabServer`), the run's exported series read back from /metrics after each
step and replayed through the shipped rules by promtool (lab v1's `first_firings`). Writes
``DIR/CONFIG-sSEED/{steps.jsonl,series.jsonl,result.json}``; ``steps.jsonl`` holds the trainer's
health scalars per step. ``--screen`` trains without the server and the replay (seconds per step
of the trainer alone). ``python -m benchmarks.collapse_lab.v2.evaluate DIR…`` prints
PROTOCOL.md's table.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.collapse_lab.replay import CANDIDATE, RULES, first_firings
from benchmarks.collapse_lab.serve import LabServer, snapshot

from .configs import CONFIGS, V2Config, collapse_onset
from .reward import REWARDS


class _NoTap:
    def report(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self, timeout: float) -> bool:
        return True

    def __enter__(self) -> _NoTap:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def lead_summary(onset: int | None, firings: list[dict[str, Any]]) -> dict[str, Any]:
    """First page and first warning of the shipped rules (any alert of that severity) and of the
    candidate rules (alerts named ``*Candidate``), and their lead over onset."""
    out: dict[str, Any] = {}
    for prefix, candidate in (("", False), ("candidate_", True)):
        for sev in ("page", "warning"):
            steps = [
                f["step"]
                for f in firings
                if f["severity"] == sev and f["alert"].endswith("Candidate") == candidate
            ]
            first = min(steps) if steps else None
            out[f"{prefix}first_{sev}"] = first
            out[f"{prefix}lead_{sev}"] = None if first is None or onset is None else onset - first
    return out


def health_scalars(log: Any) -> dict[str, float]:
    """The step's trainer health under timwatch's canonical scalar names (`Tap.log`)."""
    return {
        "reward_mean": log.reward, "reward_std": log.reward_std, "grad_norm": log.grad_norm,
        "entropy": log.entropy, "response_length_mean": log.response_len_mean,
        "response_length_max": log.response_len_max, "learning_rate": log.lr,
        "clip_fraction": log.clip_fraction, "loss": log.loss,
    }  # fmt: skip


def run_one(
    cfg: V2Config,
    seed: int,
    server: LabServer | None,
    out: Path,
    rules: Sequence[Path] = (RULES, CANDIDATE),
) -> dict[str, Any]:
    from timwatch.sidecar.tap import Tap

    from .grpo import V2Trainer

    run = f"{cfg.name}-s{seed}"
    rundir = out / run
    rundir.mkdir(parents=True, exist_ok=True)
    trainer = V2Trainer(cfg, seed)
    logs, series, step_s = [], [], []
    tap: Any = _NoTap() if server is None else Tap(server.url, run, rank=0)
    started = time.monotonic()
    with tap:
        for step in range(cfg.steps):
            t0 = time.monotonic()
            log = trainer.step(step, tap)
            tap.log(step, health_scalars(log))
            step_s.append(time.monotonic() - t0)
            if not tap.flush(60):
                raise RuntimeError(f"{run}: the tap could not deliver step {step}")
            logs.append(asdict(log))
            if server is not None:
                series.append(snapshot(server.metrics(), run))
    wall = time.monotonic() - started
    with open(rundir / "steps.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in logs)
    firings: list[dict[str, Any]] = []
    if server is not None:
        sent = cfg.steps * cfg.prompts * cfg.group * cfg.response
        counted = series[-1].get(f'timwatch_token_kl_count{{run="{run}"}}')
        if counted != sent:
            raise RuntimeError(f"{run}: sent {sent} tokens, the server exported {counted}")
        with open(rundir / "series.jsonl", "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in series)
        firings = first_firings(series, rules=rules)
    onset = collapse_onset([r["reward"] for r in logs], [r["grad_norm"] for r in logs])
    result = {
        "config": cfg.name, "seed": seed, "steps": cfg.steps, "collapse_step": onset,
        "firings": firings, **lead_summary(onset, firings), "wall_s": round(wall, 1),
        "trainer_s_per_step": round(sum(step_s) / len(step_s), 3), "replayed": server is not None,
        "settings": asdict(cfg), "pretrained": trainer.pretrain_info["key"],
    }  # fmt: skip
    (rundir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(
    config: Annotated[str, typer.Option(help=f"comma list of: {', '.join(CONFIGS)}")],
    seeds: Annotated[str, typer.Option("--seeds", "--seed", help="comma list of seeds")] = "0",
    out: Annotated[Path, typer.Option(help="output folder")] = Path("collapse-lab2-runs"),
    steps: Annotated[int, typer.Option(help="override the steps per run (0: config's)")] = 0,
    lr: Annotated[float, typer.Option(help="override the learning rate (0: config's)")] = 0.0,
    reward: Annotated[str, typer.Option(help="override the reward (class, pattern)")] = "",
    screen: Annotated[bool, typer.Option(help="trainer only: no server, no replay")] = False,
    rules: Annotated[Path, typer.Option(help="rules file replayed with the candidate's")] = RULES,
) -> None:
    """Run lab v2 configurations through tap → timwatch serve → promtool-replayed rules."""
    names = [c.strip() for c in config.split(",") if c.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise typer.BadParameter(f"unknown config {', '.join(bad)}; known: {', '.join(CONFIGS)}")
    if reward and reward not in REWARDS:
        raise typer.BadParameter(f"unknown reward {reward}; known: {', '.join(REWARDS)}")
    seed_list = [int(s) for s in seeds.split(",")]
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = None if screen else LabServer(out)
    try:
        for name in names:
            cfg = CONFIGS[name] if steps <= 0 else replace(CONFIGS[name], steps=steps)
            cfg = cfg if lr <= 0 else replace(cfg, lr=lr)
            cfg = cfg if not reward else replace(cfg, reward=reward)
            for seed in seed_list:
                r = run_one(cfg, seed, server, out, (rules, CANDIDATE))
                fired = ", ".join(f"{f['alert']}@{f['step']}" for f in r["firings"])
                print(
                    f"{name} seed {seed}: collapse {r['collapse_step']} · fired: "
                    f"{fired or 'nothing'} · {r['wall_s']} s ({r['trainer_s_per_step']} s/step)",
                    flush=True,
                )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    typer.run(main)
