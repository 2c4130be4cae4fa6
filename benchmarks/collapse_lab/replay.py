"""Replay a lab run's exported series through the shipped rules with `promtool test rules`.

One RL step is mapped onto `MINUTES_PER_STEP` minutes of Prometheus time (a GRPO step of a 7–14B
model takes minutes), the snapshot after step s becoming the sample at s minutes; the rules are
evaluated every minute by Prometheus's own rule engine, unchanged (factor 1). The first firing
time of every alert is read back from the `ALERTS` series that the engine writes: the test asks
for `min_over_time(timestamp(ALERTS{alertstate="firing"})[…])` and expects nothing, so promtool
prints what it got. Each firing is reported as the step it corresponds to.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CANDIDATE", "MINUTES_PER_STEP", "RULES", "cached_firings", "first_firings", "firings_under",
]  # fmt: skip

MINUTES_PER_STEP = 1
RULES = Path(__file__).resolve().parents[2] / "alerts" / "timwatch.rules.yml"
#: lab v2's pre-registered candidate rules, replayed together with `RULES` (whose recording rules
#: they read)
CANDIDATE = Path(__file__).resolve().parent / "v2" / "candidate.rules.yml"
_SAMPLE = re.compile(r"\{([^}]*)\}\s+([-+0-9.eE]+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _paths(rules: Path | Sequence[Path]) -> list[Path]:
    return [rules] if isinstance(rules, Path) else [Path(r) for r in rules]


def _test_file(series: list[dict[str, float]], rules: Path | Sequence[Path]) -> dict[str, Any]:
    names = list(dict.fromkeys(k for snap in series for k in snap))
    inputs = [
        {"series": name, "values": " ".join(_fmt(snap.get(name)) for snap in series)}
        for name in names
    ]
    end = (len(series) - 1) * MINUTES_PER_STEP
    expr = f'min_over_time(timestamp(ALERTS{{alertstate="firing"}})[{end}m:1m])'
    return {
        # absolute: promtool reads rule files relative to the test file, which is in a temp dir
        "rule_files": [str(r.resolve()) for r in _paths(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": f"{MINUTES_PER_STEP}m",
                "input_series": inputs,
                "promql_expr_test": [{"expr": expr, "eval_time": f"{end}m", "exp_samples": []}],
            }
        ],
    }


def _fmt(v: float | None) -> str:
    return "_" if v is None else repr(float(v))


def first_firings(
    series: list[dict[str, float]],
    rules: Path | Sequence[Path] = RULES,
    promtool: str = "promtool",
) -> list[dict[str, Any]]:
    """Every alert that fired, once per label set: alertname, severity, policy, first step.
    ``rules``: one rules file, or several evaluated together (a candidate group reading the
    shipped file's recording rules)."""
    exe = shutil.which(promtool)
    if exe is None:
        raise RuntimeError("promtool is not installed (apt-get install prometheus)")
    missing = [str(r) for r in _paths(rules) if not r.is_file()]
    if missing:  # promtool only warns, and replays without them
        raise FileNotFoundError(f"no rules file {', '.join(missing)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "replay.test.yml"
        path.write_text(yaml.safe_dump(_test_file(series, rules), sort_keys=False))
        res = subprocess.run(
            [exe, "test", "rules", str(path)], capture_output=True, text=True, timeout=600
        )
    out = res.stdout + res.stderr
    if res.returncode == 0:
        return []
    if "got:" not in out:
        raise RuntimeError(f"promtool failed:\n{out}")
    got = out[out.index("got:") :]
    firings = []
    for labels, value in _SAMPLE.findall(got):
        lab = dict(_LABEL.findall(labels))
        minutes = float(value) / 60.0
        firings.append(
            {
                "alert": lab.get("alertname", "?"),
                "severity": lab.get("severity", "?"),
                "policy": lab.get("policy"),
                "step": int(round(minutes / MINUTES_PER_STEP)),
            }
        )
    return sorted(firings, key=lambda f: (f["step"], f["alert"]))


def cached_firings(rundir: Path, rules: Sequence[Path]) -> list[dict[str, Any]]:
    """`first_firings` of the run in ``rundir`` (its ``series.jsonl``) under ``rules`` evaluated
    together, cached in ``rundir/replay.json`` under a hash of the rules files' bytes: an edited
    rule replays again, an unchanged one reads the cache."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in rules)).hexdigest()[:16]
    cache = rundir / "replay.json"
    if cache.exists():
        cached = json.loads(cache.read_text())
        if cached.get("rules") == key:
            return list(cached["firings"])
    series = [json.loads(x) for x in (rundir / "series.jsonl").open()]
    firings = first_firings(series, rules=rules)
    cache.write_text(json.dumps({"rules": key, "firings": firings}))
    return firings


def firings_under(series: list[dict[str, float]], rules: dict[str, Any]) -> list[dict[str, Any]]:
    """`first_firings` of ``series`` under a rules document given as data (a candidate grid)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rules.yml"
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
        return first_firings(series, rules=path)


def rereplay(dirs: list[Path], rules: Path = RULES) -> int:
    """Replace the firings of every run under ``dirs`` (DIR/*/result.json) by a replay of its
    stored series against ``rules``; returns the number of runs rewritten."""
    import json

    from benchmarks.collapse_lab.__main__ import lead_summary

    n = 0
    for d in dirs:
        for res in sorted(d.glob("*/result.json")):
            series = [json.loads(line) for line in (res.parent / "series.jsonl").open()]
            r = json.loads(res.read_text())
            r["firings"] = first_firings(series, rules=rules)
            r.update(lead_summary(r["collapse_step"], r["firings"]))
            r["rules"] = str(rules)
            res.write_text(json.dumps(r, indent=1))
            n += 1
    return n


if __name__ == "__main__":
    import sys

    # python -m benchmarks.collapse_lab.replay RULES_FILE DIR [DIR…]
    print(f"replayed {rereplay([Path(p) for p in sys.argv[2:]], Path(sys.argv[1]))} runs")
