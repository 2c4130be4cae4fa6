"""Feed a lab v2 run's step scalars to rlwatch 0.5.1's detectors (its `DetectorSuite`, the part
`RLWatch.log_step` runs, without its storage and alert delivery) and record each run's first
critical and first warning-or-critical alert.

Runs in rlwatch's own virtualenv (it needs scipy, slack-sdk, …; never a timwatch dependency):
``~/.cache/timwatch/venv-rlwatch-0.5.1/bin/python -m benchmarks.collapse_lab.v2.rlwatch_replay
DIR…`` with the repository on PYTHONPATH; imports only the standard library and rlwatch.
Scalars fed per step: entropy, kl_divergence (the run's mismatch k3 of π vs μ), reward_mean,
reward_std (lab v1's runs have none: not fed), grad_norm; lab v1's run folders work too. Writes
``rlwatch.json`` beside each run's ``result.json``: the defaults' firings (with each detector's
first step) and those of every threshold combination of `GRID` (PROTOCOL.md fixes it).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["GRID", "first_alerts"]

# (entropy threshold, KL sigma multiplier, gradient-norm sigma multiplier); defaults 1.0, 3, 3
GRID = list(itertools.product((0.5, 1.0, 2.0, 3.0), (3.0, 5.0, 8.0, 12.0), (3.0, 5.0, 8.0, 12.0)))


def first_alerts(steps: list[dict[str, Any]], combo: tuple[float, float, float] | None) -> dict:
    """First step of a critical alert and of any alert (None if none), and which detectors."""
    from rlwatch.config import RLWatchConfig  # type: ignore[import-not-found]
    from rlwatch.detectors import DetectorSuite  # type: ignore[import-not-found]

    cfg = RLWatchConfig()
    if combo is not None:
        cfg.entropy_collapse.threshold = combo[0]
        cfg.kl_explosion.sigma_multiplier = combo[1]
        cfg.gradient_norm_spike.sigma_multiplier = combo[2]
    suite = DetectorSuite(cfg)
    crit = warn = None
    first: dict[str, int] = {}  # "detector:severity" -> its first step
    for s in steps:
        alerts = suite.check_step(
            s["step"], entropy=s["entropy"], kl_divergence=s["mismatch_kl"],
            reward_mean=s["reward"], reward_std=s.get("reward_std"), grad_norm=s["grad_norm"],
        )  # fmt: skip
        for a in alerts:
            first.setdefault(f"{a.detector}:{a.severity}", s["step"])
            if warn is None:
                warn = s["step"]
            if a.severity == "critical" and crit is None:
                crit = s["step"]
    return {"first_critical": crit, "first_alert": warn, "alerts": sorted(first), "first": first}


def main(dirs: list[str]) -> None:
    for d in dirs:
        for res in sorted(Path(d).glob("*/result.json")):
            steps = [json.loads(x) for x in (res.parent / "steps.jsonl").open()]
            out = {"defaults": first_alerts(steps, None)}
            out["grid"] = {",".join(map(str, c)): first_alerts(steps, c) for c in GRID}
            (res.parent / "rlwatch.json").write_text(json.dumps(out))
            print(res.parent.name, json.dumps(out["defaults"]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
