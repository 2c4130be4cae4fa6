"""``python -m benchmarks.collapse_lab.levels DIR|FILE [...] [--tune 0,1,2] [--hold 3,4,5]``: tune
the thresholds of the level warnings (TimwatchMismatchKLHigh, TimwatchMaskRatioHigh) on some
seeds, then read the held-out seeds once against the thresholds before the lab (`BEFORE`).

Objective, fixed before the grid was evaluated: a level warning is useful as a collapse warning
if it fires at or before the onset on the runs that collapse and stays quiet on the runs that do
not. Score = share of collapsed runs warned at or before onset − share of non-collapsed runs
warned at any step (Youden's J; the thresholds shipped before the lab score about 0 there, firing
on almost every mismatched run). The choice on the tuning seeds is the largest J, then the
fewest false warnings, then the thresholds nearest those before. A change is worth shipping
only if its held-out J is larger than the held-out J of the thresholds before it (`BEFORE`).

Every threshold of the grid is one alert of one rules file (the shipped rules plus the grid,
`for: 15m` as shipped), so one `promtool test rules` per run evaluates all of them with
Prometheus's own engine (`replay.first_firings`); the first firing of each is cached in the run
folder (``levels.json``) and kept by the report's ``--export``. A combination's first warning is
the earliest of its components'.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from benchmarks.collapse_lab.replay import RULES, firings_under
from benchmarks.collapse_lab.report import load

__all__ = ["GRID", "BEFORE", "candidate_rules", "first_warning", "level_firings"]

TOKEN = "estr|delta_abs|icepop|kpop|tis"
SEQ = "seq_mis|k3_rs"
# component -> (selector, thresholds); None = that part of the warning removed
GRID: dict[str, tuple[str, tuple[float | None, ...]]] = {
    "kl": ("timwatch:mismatch_kl:rate10m", (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)),
    "tok": (f'timwatch:mask_ratio:rate10m{{policy=~"{TOKEN}"}}', (0.02, 0.05, 0.1, 0.2, None)),
    "seq": (f'timwatch:mask_ratio:rate10m{{policy=~"{SEQ}"}}', (0.2, 0.3, 0.5, 0.8, None)),
    "geo": ('timwatch:mask_ratio:rate10m{policy="geo_rs"}', (0.5, 0.8, 0.9, 0.95, 0.99, None)),
}
# the thresholds of alerts/timwatch.rules.yml before the lab changed them (commit 6e9c5bf)
BEFORE = {"kl": 0.01, "tok": 0.02, "seq": 0.2, "geo": 0.5}


def alert_name(comp: str, thr: float) -> str:
    return f"Level_{comp}_{thr:g}".replace(".", "p")


def candidate_rules() -> dict[str, Any]:
    """The shipped rules plus one `for: 15m` alert per (component, threshold) of the grid."""
    rules = yaml.safe_load(RULES.read_text())
    alerts = [
        {"alert": alert_name(c, t), "expr": f"{sel} > {t}", "for": "15m",
         "labels": {"severity": "level"}}
        for c, (sel, ts) in GRID.items() for t in ts if t is not None
    ]  # fmt: skip
    # in the shipped group, after its recording rules: a second group would read them one
    # evaluation (one step) late
    rules["groups"][0]["rules"].extend(alerts)
    return dict(rules)


def level_firings(run_dir: Path, series: list[dict[str, float]]) -> dict[str, int | None]:
    """First firing step (any label set) of every grid alert; cached in the run folder."""
    cache = run_dir / "levels.json"
    if cache.exists():
        return dict(json.loads(cache.read_text()))
    firings = firings_under(series, candidate_rules())
    out: dict[str, int | None] = {
        alert_name(c, t): None for c, (_, ts) in GRID.items() for t in ts if t is not None
    }
    for fr in firings:
        k = fr["alert"]
        if k in out and (out[k] is None or fr["step"] < out[k]):  # type: ignore[operator]
            out[k] = fr["step"]
    cache.write_text(json.dumps(out))
    return out


def first_warning(levels: dict[str, int | None], combo: dict[str, float | None]) -> int | None:
    steps = [levels[alert_name(c, t)] for c, t in combo.items() if t is not None]
    hits = [s for s in steps if s is not None]
    return min(hits) if hits else None


def score(runs: list[dict[str, Any]], combo: dict[str, float | None]) -> dict[str, Any]:
    det = col = false = calm = 0
    for r in runs:
        first, onset = first_warning(r["levels"], combo), r["collapse_step"]
        if onset is None:
            calm += 1
            false += first is not None
        else:
            col += 1
            det += first is not None and first <= onset
    j = (det / col if col else 0.0) - (false / calm if calm else 0.0)
    return {"detected": det, "collapsed": col, "false": false, "calm": calm, "j": j}


def _distance(combo: dict[str, float | None]) -> int:
    """Grid steps away from the thresholds before the lab (a removed part: the last step)."""
    return sum(abs(GRID[c][1].index(t) - GRID[c][1].index(BEFORE[c])) for c, t in combo.items())


def combos() -> list[dict[str, float | None]]:
    keys = list(GRID)
    return [dict(zip(keys, v, strict=True)) for v in itertools.product(*(GRID[k][1] for k in keys))]


def choose(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    def key(c: dict[str, float | None]) -> tuple[float, int, int]:
        s = score(runs, c)
        return (round(s["j"], 9), -s["false"], -_distance(c))

    return max(combos(), key=key)


def _fmt(s: dict[str, Any]) -> str:
    return (
        f"{s['detected']}/{s['collapsed']} collapses warned by onset, "
        f"{s['false']}/{s['calm']} non-collapsed warned, J {s['j']:+.2f}"
    )


def _groups(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    def fam(r: dict[str, Any]) -> str:
        c = r["config"]
        if c.startswith("control"):
            return "matched fp32 controls"
        if c.startswith(("int4lr3", "lag2blr3")):
            return "pushed sources (int4lr3, lag2blr3)"
        return "lr 1e-3 mismatched (bf16, topk, fp8, lag2, lag2b)"

    out: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(fam(r), []).append(r)
    return dict(sorted(out.items()))


def main(
    dirs: Annotated[list[Path], typer.Argument(help="lab output folders or --export files")],
    tune: Annotated[str, typer.Option(help="seeds to tune on")] = "0,1,2",
    hold: Annotated[str, typer.Option(help="held-out seeds")] = "3,4,5",
) -> None:
    """Tune the level-warning thresholds on --tune seeds; print the held-out comparison."""
    runs = load(dirs)
    for r in runs:
        if r.get("levels") is None:
            if not r["series"]:
                raise typer.BadParameter(f"{r['config']} seed {r['seed']}: no series to replay")
            r["levels"] = level_firings(Path(r["dir"]), r["series"])
    tune_s = {int(s) for s in tune.split(",")}
    hold_s = {int(s) for s in hold.split(",")}
    tuning = [r for r in runs if r["seed"] in tune_s]
    held = [r for r in runs if r["seed"] in hold_s]
    best = choose(tuning)
    before: dict[str, float | None] = dict(BEFORE)
    show = ", ".join(f"{k} {'off' if v is None else f'{v:g}'}" for k, v in best.items())
    print(f"chosen on seeds {sorted(tune_s)} ({len(tuning)} runs): {show}")
    for label, part in (("tuning", tuning), ("held-out", held)):
        print(f"\n{label} seeds ({len(part)} runs)")
        print("| runs | thresholds before the lab | chosen thresholds |\n|---|---|---|")
        for g, rs in [("all", part), *_groups(part).items()]:
            print(f"| {g} ({len(rs)}) | {_fmt(score(rs, before))} | {_fmt(score(rs, best))} |")
    verdict = score(held, best)["j"] > score(held, before)["j"]
    print(f"\nheld-out J of the chosen thresholds larger than before: {verdict}")


if __name__ == "__main__":
    typer.run(main)
