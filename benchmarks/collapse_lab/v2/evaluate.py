"""The table PROTOCOL.md fixes, from lab v2's run folders:
``python -m benchmarks.collapse_lab.v2.evaluate DIR… [--json FILE] [--plots DIR]``.

Each run's exported series (``series.jsonl``) is replayed by promtool through the shipped rules
and the candidate rules together (cached in ``replay.json`` beside it, keyed by the rules'
bytes); rlwatch 0.5.1's alerts come from ``rlwatch.json``, written by `rlwatch_replay` in
rlwatch's own virtualenv (run here when missing). A detector's *page* on a run is its first
firing; it is *in time* on a collapsed run when it fires at or before onset − ⌈10 % of the
run's steps⌉, and false on a run that did not collapse whenever it fires. rlwatch's tuned
thresholds are chosen on the tuning seeds by Youden's J (ties: fewer false pages, then the
combination closest to its defaults) and only then read on the held-out seeds.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.collapse_lab.replay import CANDIDATE, RULES, cached_firings
from benchmarks.collapse_lab.report import finish_figure

from .rlwatch_replay import GRID

__all__ = ["TUNING", "detectors", "in_time", "load", "summarise", "wilson"]

#: PROTOCOL.md: tuning seeds; every other seed is held out
TUNING = (0, 1)
RLWATCH_DEFAULTS = (1.0, 3.0, 3.0)
RLWATCH_PY = Path.home() / ".cache/timwatch/venv-rlwatch-0.5.1/bin/python"
REPO = Path(__file__).resolve().parents[3]


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float] | None:
    """Wilson score 95 % interval of k successes in n trials (None when n = 0)."""
    if n == 0:
        return None
    p = k / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def in_time(step: int | None, onset: int, steps: int) -> bool:
    """A firing at least 10 % of the run's steps (rounded up) before onset."""
    return step is not None and step <= onset - math.ceil(0.1 * steps)


def _rlwatch(rundir: Path) -> dict[str, Any]:
    path = rundir / "rlwatch.json"
    if not path.exists():
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run(
            [str(RLWATCH_PY), "-m", f"{__package__}.rlwatch_replay", str(rundir.parent)],
            check=True, env=env, cwd=REPO, capture_output=True, timeout=1800,
        )  # fmt: skip
    return dict(json.loads(path.read_text()))


def load(dirs: list[Path]) -> list[dict[str, Any]]:
    """Every replayed run under ``dirs`` with its firings and rlwatch's alerts."""
    runs = []
    for d in dirs:
        for res in sorted(d.glob("*/result.json")):
            r = json.loads(res.read_text())
            if not r.get("replayed"):
                continue
            r["firings"] = cached_firings(res.parent, (RULES, CANDIDATE))
            r["rlwatch"] = _rlwatch(res.parent)
            r["log"] = [json.loads(x) for x in (res.parent / "steps.jsonl").open()]
            r["dir"] = str(res.parent)
            runs.append(r)
    return runs


def _first(r: dict[str, Any], keep: Callable[[dict[str, Any]], bool]) -> int | None:
    steps = [f["step"] for f in r["firings"] if keep(f)]
    return min(steps) if steps else None


def _shipped(sev: str) -> Callable[[dict[str, Any]], int | None]:
    return lambda r: _first(
        r, lambda f: f["severity"] == sev and not f["alert"].endswith("Candidate")
    )


def _alert(name: str) -> Callable[[dict[str, Any]], int | None]:
    return lambda r: _first(r, lambda f: f["alert"] == name)


def _rl(combo: tuple[float, ...] | None) -> Callable[[dict[str, Any]], int | None]:
    def first(r: dict[str, Any]) -> int | None:
        rl = r["rlwatch"]
        got = rl["defaults"] if combo is None else rl["grid"][",".join(map(str, combo))]
        return got["first_critical"]

    return first


def _score(runs: list[dict[str, Any]], first: Callable[[dict[str, Any]], int | None]) -> dict:
    col = [r for r in runs if r["collapse_step"] is not None]
    healthy = [r for r in runs if r["collapse_step"] is None]
    timely = [r for r in col if in_time(first(r), r["collapse_step"], r["steps"])]
    leads = [r["collapse_step"] - first(r) for r in timely]  # type: ignore[operator]
    false = [r for r in healthy if first(r) is not None]
    tpr = len(timely) / len(col) if col else 0.0
    fpr = len(false) / len(healthy) if healthy else 0.0
    return {
        "collapsed": len(col), "paged_in_time": len(timely),
        "median_lead": statistics.median(leads) if leads else None,
        "healthy": len(healthy), "false_pages": len(false), "j": tpr - fpr,
        "tpr_ci": wilson(len(timely), len(col)), "fpr_ci": wilson(len(false), len(healthy)),
    }  # fmt: skip


def tune_rlwatch(runs: list[dict[str, Any]]) -> tuple[float, ...]:
    """The rlwatch threshold combination with the largest J on ``runs`` (the tuning seeds)."""

    def dist(c: tuple[float, ...]) -> float:
        return sum(abs(math.log(a / b)) for a, b in zip(c, RLWATCH_DEFAULTS, strict=True))

    def key(c: tuple[float, ...]) -> tuple[float, int, float]:
        s = _score(runs, _rl(c))
        return (-s["j"], s["false_pages"], dist(c))

    return min((tuple(c) for c in GRID), key=key)


def detectors(tuned: tuple[float, ...]) -> dict[str, Callable[[dict[str, Any]], int | None]]:
    """PROTOCOL.md's detectors: each run's first firing step, or None."""
    return {
        "timwatch page (shipped)": _shipped("page"),
        "timwatch warnings (shipped)": _shipped("warning"),
        "timwatch candidate page": _alert("TimwatchCollapseRiskCandidate"),
        "rlwatch defaults (critical)": _rl(None),
        f"rlwatch tuned {tuned} (critical)": _rl(tuned),
        "shipped TimwatchEntropyCollapse": _alert("TimwatchEntropyCollapse"),
        "candidate TimwatchEntropyCollapseCandidate": _alert("TimwatchEntropyCollapseCandidate"),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration and pooled, per detector, on the held-out seeds (the tuning seeds'
    rows apart, marked)."""
    tuning = [r for r in runs if r["seed"] in TUNING]
    held = [r for r in runs if r["seed"] not in TUNING]
    tuned = tune_rlwatch(tuning)
    dets = detectors(tuned)
    out: dict[str, Any] = {"rlwatch_tuned": tuned, "sets": {}}
    for label, subset in (("held-out", held), ("tuning", tuning)):
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in subset:
            groups.setdefault(r["config"], []).append(r)
        groups["pooled: all"] = subset
        groups["pooled: mismatched"] = [r for r in subset if not r["config"].startswith("control")]
        groups["pooled: matched controls"] = [
            r for r in subset if r["config"].startswith("control")
        ]
        out["sets"][label] = {
            g: {
                "runs": len(rs),
                "seeds": sorted({r["seed"] for r in rs}),
                "collapse_steps": [r["collapse_step"] for r in sorted(rs, key=lambda r: r["seed"])],
                "detectors": {d: _score(rs, f) for d, f in dets.items()},
            }
            for g, rs in groups.items()
            if rs
        }
    out["runs"] = [
        {
            "config": r["config"],
            "seed": r["seed"],
            "lr": r["settings"]["lr"],
            "collapse_step": r["collapse_step"],
            "first": {d: f(r) for d, f in dets.items()},
            "reward_first10": round(statistics.mean(x["reward"] for x in r["log"][:10]), 4),
            "reward_last10": round(statistics.mean(x["reward"] for x in r["log"][-10:]), 4),
            "mismatch_kl_mean": statistics.mean(x["mismatch_kl"] for x in r["log"]),
            "grad_norm_max": max(x["grad_norm"] for x in r["log"]),
            "entropy_last": r["log"][-1]["entropy"],
        }  # fmt: skip
        for r in runs
    ]
    return out


def _ci(ci: list[float] | tuple[float, float] | None) -> str:
    return "–" if ci is None else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def _cell(s: dict[str, Any]) -> str:
    """``in time k/n · lead L · false k/n`` of one detector on one group of runs."""
    parts = []
    if s["collapsed"]:
        lead = "" if s["median_lead"] is None else f" (lead {s['median_lead']:g})"
        parts.append(f"{s['paged_in_time']}/{s['collapsed']} in time{lead}")
    if s["healthy"]:
        parts.append(f"{s['false_pages']}/{s['healthy']} false")
    return " · ".join(parts) or "–"


def markdown(summary: dict[str, Any]) -> str:
    """Per set of seeds: each detector pooled (with Wilson intervals), then each configuration
    (counts), then every run."""
    lines = []
    for label, groups in summary["sets"].items():
        if not groups:
            lines += [f"**{label} seeds**: no runs yet", ""]
            continue
        names = list(next(iter(groups.values()))["detectors"])
        pooled = {g: row for g, row in groups.items() if g.startswith("pooled")}
        lines += [
            f"**{label} seeds, pooled**",
            "",
            "| detector | "
            + " | ".join(
                f"{g.removeprefix('pooled: ')} ({row['runs']} runs, "
                f"{sum(c is not None for c in row['collapse_steps'])} collapsed)"
                for g, row in pooled.items()
            )
            + " |",
            "|---|" + "---|" * len(pooled),
        ]
        for d in names:
            cells = []
            for row in pooled.values():
                s = row["detectors"][d]
                ci = f" {_ci(s['tpr_ci'])}" if s["collapsed"] else ""
                fci = f" {_ci(s['fpr_ci'])}" if s["healthy"] else ""
                cells.append(_cell(s).replace(" in time", f" in time{ci}") + fci)
            lines.append(f"| {d} | " + " | ".join(cells) + " |")
        per = {g: row for g, row in groups.items() if not g.startswith("pooled")}
        lines += [
            "",
            f"**{label} seeds, per configuration**",
            "",
            "| configuration | collapse steps | " + " | ".join(names) + " |",
            "|---|---|" + "---|" * len(names),
        ]
        for g, row in sorted(per.items()):
            steps = ", ".join(str(c) if c is not None else "–" for c in row["collapse_steps"])
            cells = [_cell(row["detectors"][d]) for d in names]
            lines.append(f"| {g} (seeds {','.join(map(str, row['seeds']))}) | {steps} | "
                         + " | ".join(cells) + " |")  # fmt: skip
        lines.append("")
    lines += [
        "**every run**",
        "",
        "| run | collapse step | reward first / last 10 steps | mean mismatch k3 | max grad "
        "norm | last entropy | first: shipped page, warning; candidate page; rlwatch "
        "defaults, tuned |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(summary["runs"], key=lambda r: (r["config"], r["lr"], r["seed"])):
        f = list(r["first"].values())
        firsts = f"{f[0]}, {f[1]}; {f[2]}; {f[3]}, {f[4]}".replace("None", "–")
        lines.append(
            f"| {r['config']} s{r['seed']} lr {r['lr']:g} | {r['collapse_step'] or '–'} | "
            f"{r['reward_first10']:.3f} / {r['reward_last10']:.3f} | {r['mismatch_kl_mean']:.3g} | "
            f"{r['grad_norm_max']:.3g} | {r['entropy_last']:.2f} | {firsts} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], pick: list[tuple[str, int]], path: Path) -> None:
    """Reward, gradient norm, mismatch k3 and entropy of the picked runs, with each detector's
    first firing marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tuned = tune_rlwatch([r for r in runs if r["seed"] in TUNING])
    dets = detectors(tuned)
    marks: dict[str, Any] = {
        "timwatch page (shipped)": "--",
        "timwatch warnings (shipped)": ":",
        "timwatch candidate page": "-.",
        "rlwatch defaults (critical)": (0, (6, 2, 1, 2, 1, 2)),
    }
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    chosen = [r for c, s in pick for r in runs if r["config"] == c and r["seed"] == s]
    for i, r in enumerate(chosen):
        c = f"C{i}"
        x = [s["step"] for s in r["log"]]
        axes[0].plot(
            x,
            [s["reward"] for s in r["log"]],
            c,
            lw=0.8,
            label=f"{r['config']} s{r['seed']} lr {r['settings']['lr']:g}",
        )
        axes[1].semilogy(x, [max(s["grad_norm"], 1e-6) for s in r["log"]], c, lw=0.8)
        axes[2].semilogy(x, [max(s["mismatch_kl"], 1e-14) for s in r["log"]], c, lw=0.8)
        axes[3].plot(x, [s["entropy"] for s in r["log"]], c, lw=0.8)
        if r["collapse_step"] is not None:
            for ax in axes:
                ax.axvline(r["collapse_step"], color=c, lw=1.5, alpha=0.5)
        for d, ls in marks.items():
            step = dets[d](r)
            if step is not None:
                for ax in axes:
                    ax.axvline(step, color=c, ls=ls, lw=0.9)
    finish_figure(
        fig, axes, ["reward", "grad norm (pre-clip)", "mismatch k3 KL", "entropy (nats)"],
        "lab v2 · solid: collapse onset · dashed: shipped page · dotted: first shipped warning · "
        "dash-dot: candidate page · dash-dot-dot: rlwatch critical",
        path, 80,
    )  # fmt: skip


def main(
    dirs: list[Path],
    json_out: Annotated[Path | None, typer.Option("--json", help="write the summary")] = None,
    plot_runs: Annotated[
        str, typer.Option("--plot", help="CONFIG:SEED[,CONFIG:SEED…] to draw")
    ] = "",
    plot_out: Annotated[Path, typer.Option(help="the plot's file")] = Path("lab2.png"),
) -> None:
    """Print PROTOCOL.md's table for the runs under DIRS."""
    runs = load(dirs)
    if not runs:
        sys.exit("no replayed runs under " + ", ".join(map(str, dirs)))
    summary = summarise(runs)
    if json_out is not None:
        json_out.write_text(json.dumps(summary, indent=1) + "\n")
    print(markdown(summary))
    if plot_runs:
        pick = [(p.rsplit(":", 1)[0], int(p.rsplit(":", 1)[1])) for p in plot_runs.split(",")]
        plot(runs, pick, plot_out)


if __name__ == "__main__":
    typer.run(main)
