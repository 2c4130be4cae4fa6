"""``python -m benchmarks.collapse_lab.screen --set engine=int4 --set lr=3e-3 --seeds 0,1,2``:
the trainer alone (no tap, no server, no replay), to screen how far a mismatch source must be
pushed before a run collapses; prints one JSON line per seed (collapse onset under
`configs.collapse_onset`, best 5-step mean reward, mean of the last 20 steps, largest gradient
norm after the warm-up, mean mismatch k3). The same trainer and seed as the full lab run, so a
configuration that collapses here collapses there (the tap only observes)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Annotated, Any

import typer

from benchmarks.collapse_lab.configs import WARMUP, LabConfig, collapse_onset


class _NoTap:
    def report(self, *args: Any, **kwargs: Any) -> None:
        pass


def _value(name: str, raw: str) -> Any:
    kind = {f.name: f.type for f in fields(LabConfig)}[name]
    return {"int": int, "float": float}.get(str(kind), str)(raw)


def main(
    sets: Annotated[list[str], typer.Option("--set", help="FIELD=VALUE of LabConfig")],
    seeds: Annotated[str, typer.Option(help="comma list of seeds")] = "0",
) -> None:
    """Train the configured lab run without reporting; print its collapse screen per seed."""
    from benchmarks.collapse_lab.grpo import LabTrainer

    spec = {k: _value(k, v) for k, v in (s.split("=", 1) for s in sets)}
    cfg = LabConfig(name="screen", **spec)
    for seed in (int(s) for s in seeds.split(",")):
        trainer, tap, logs = LabTrainer(cfg, seed), _NoTap(), []
        for step in range(cfg.steps):
            logs.append(trainer.step(step, tap))
        r = [x.reward for x in logs]
        g = [x.grad_norm for x in logs]
        smooth = [sum(r[i - 4 : i + 1]) / 5 for i in range(4, len(r))]
        out = {
            **spec, "seed": seed, "collapse_step": collapse_onset(r, g),
            "best_reward_5": round(max(smooth), 2), "final_reward_20": round(sum(r[-20:]) / 20, 2),
            "max_grad_after_warmup": round(max(g[WARMUP:]), 1),
            "mean_mismatch_kl": float(f"{sum(x.mismatch_kl for x in logs) / len(logs):.3g}"),
        }  # fmt: skip
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    typer.run(main)
