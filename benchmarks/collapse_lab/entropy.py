"""``python -m benchmarks.collapse_lab.entropy DIR… [--candidate FILE --alert NAME] [--json OUT]``:
PROTOCOL-entropy.md's table and the decisions of PROTOCOL-entropy.md (`decide`) and of
PROTOCOL-entropy2.md and PROTOCOL-entropy3.md (`decide_state`).

Every lab v1 run under ``DIR/*/`` (``result.json``, ``steps.jsonl``, ``series.jsonl``) is
replayed through the shipped rules together with a candidate file: lab v2's (its
`TimwatchEntropyCollapseCandidate` reads the run's reward scalars) unless ``--candidate`` names
another, such as ``entropy3.rules.yml`` (`replay.cached_firings`, so an edited rule replays
again). The protocols judged their candidates against the rule that read entropy alone:
``--rules`` takes that file (``git show 2ddf5b6:alerts/timwatch.rules.yml``), as the shipped
rule now holds PROTOCOL-entropy3.md's clause. A run is *converged* when it did not collapse and
its last 20 steps' mean reward is at least `CONVERGED_REWARD`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.collapse_lab.replay import CANDIDATE, RULES, cached_firings
from benchmarks.collapse_lab.report import finish_figure

SHIPPED_ALERT = "TimwatchEntropyCollapse"
CANDIDATE_ALERT = "TimwatchEntropyCollapseCandidate"
CONVERGED_REWARD = 0.5
#: the candidate may fire at most this many steps after the shipped rule on a collapsed run
MAX_DELAY = 10


def _first(firings: list[dict[str, Any]], alert: str) -> int | None:
    steps = [f["step"] for f in firings if f["alert"] == alert]
    return min(steps) if steps else None


def reward_at(rewards: list[float], step: int) -> tuple[float, float]:
    """The run's reward where a rule fired at ``step``: the mean of the 10 steps up to it over
    the mean of the first 20 steps (its gain on the run's own start), and that mean minus the
    mean of the 10 steps 20 before (its change over the last 20 steps)."""
    now = statistics.fmean(rewards[max(step - 9, 0) : step + 1])
    start = statistics.fmean(rewards[:20])
    before = statistics.fmean(rewards[max(step - 29, 0) : max(step - 19, 1)])
    return now / start, now - before


def row(
    rundir: Path, candidate: Path = CANDIDATE, alert: str = CANDIDATE_ALERT, rules: Path = RULES
) -> dict[str, Any]:
    """One run: its outcome and the first step of the shipped (``rules``) and of the candidate
    rule."""
    result = json.loads((rundir / "result.json").read_text())
    firings = cached_firings(rundir, (rules, candidate))
    rewards = [json.loads(line)["reward"] for line in (rundir / "steps.jsonl").open()]
    last20 = statistics.fmean(rewards[-20:])
    onset = result["collapse_step"]
    shipped = _first(firings, SHIPPED_ALERT)
    gain, change = (None, None) if shipped is None else reward_at(rewards, shipped)
    return {
        "config": result["config"], "seed": result["seed"], "collapse_step": onset,
        "reward_last20": round(last20, 4),
        "converged": onset is None and last20 >= CONVERGED_REWARD,
        "shipped": shipped, "candidate": _first(firings, alert),
        "reward_gain_at_shipped": None if gain is None else round(gain, 3),
        "reward_change20_at_shipped": None if change is None else round(change, 3),
    }  # fmt: skip


def _groups(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The converged runs and the collapsed ones."""
    return [r for r in rows if r["converged"]], [r for r in rows if r["collapse_step"] is not None]


def _decision(
    rows: list[dict[str, Any]], third: str, third_holds: bool, counts: dict[str, int]
) -> dict[str, Any]:
    """Both protocols' decision: their shared conditions 1 (the shipped rule fires on at least
    half of the converged runs) and 2 (the candidate on none of them), then their own third."""
    converged, collapsed = _groups(rows)
    shipped_conv = sum(r["shipped"] is not None for r in converged)
    cand_conv = sum(r["candidate"] is not None for r in converged)
    conditions = {
        "1 shipped fires on at least half of the converged runs": bool(converged)
        and 2 * shipped_conv >= len(converged),
        "2 candidate fires on no converged run": cand_conv == 0,
        third: third_holds,
    }
    return {
        "runs": len(rows), "converged": len(converged), "collapsed": len(collapsed),
        "shipped_on_converged": shipped_conv, "candidate_on_converged": cand_conv, **counts,
        "conditions": conditions, "ship": all(conditions.values()),
    }  # fmt: skip


def decide(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """PROTOCOL-entropy.md's three conditions on ``rows`` and whether the clause ships (all
    three): the third, the candidate within `MAX_DELAY` steps of the shipped rule on each of at
    least 3 collapses the shipped rule fired on."""
    hit = [r for r in _groups(rows)[1] if r["shipped"] is not None]
    kept = [
        r for r in hit if r["candidate"] is not None and r["candidate"] - r["shipped"] <= MAX_DELAY
    ]
    return _decision(
        rows,
        "3 at least 3 collapsed runs get the shipped rule, the candidate on each within 10 steps",
        len(hit) >= 3 and len(kept) == len(hit),
        {"collapsed_with_shipped": len(hit), "of_them_candidate_in_time": len(kept)},
    )


def decide_state(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """PROTOCOL-entropy2.md's three conditions on ``rows``: the candidate as a warning about
    the run's state (silent on converged runs, on at least 3/4 of the collapses at any step)."""
    converged, collapsed = _groups(rows)
    fired = [r for r in collapsed if r["candidate"] is not None]
    neither = [r for r in rows if r not in converged and r not in collapsed]
    return _decision(
        rows,
        "3 at least 3 collapsed runs, the candidate on at least 3/4 of them",
        len(collapsed) >= 3 and 4 * len(fired) >= 3 * len(collapsed),
        {
            "candidate_on_collapsed": len(fired),
            "of_them_before_onset": sum(r["candidate"] < r["collapse_step"] for r in fired),
            "neither": len(neither),
            "candidate_on_neither": sum(r["candidate"] is not None for r in neither),
        },
    )


def plot(rows: list[dict[str, Any]], rundirs: list[Path], path: Path) -> None:
    """Reward and entropy of the runs in ``rundirs`` (one colour each), with the collapse onset
    (solid), the old rule's first firing (dotted) and the candidate's (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_run = {f"{r['config']}-s{r['seed']}": r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for i, rundir in enumerate(rundirs):
        r, c = by_run[rundir.name], f"C{i}"
        steps = [json.loads(line) for line in (rundir / "steps.jsonl").open()]
        x = range(len(steps))
        collapsed = r["collapse_step"] is not None
        kind = "converged" if r["converged"] else "collapsed" if collapsed else "neither"
        axes[0].plot(x, [s["reward"] for s in steps], c, lw=0.8, label=f"{rundir.name} ({kind})")
        axes[1].semilogy(x, [max(s["entropy"], 1e-4) for s in steps], c, lw=0.8)
        for step, ls in ((r["collapse_step"], "-"), (r["shipped"], ":"), (r["candidate"], "--")):
            if step is not None:
                for ax in axes:
                    ax.axvline(step, color=c, ls=ls, lw=1.2 if ls == "-" else 0.9)
    finish_figure(
        fig, axes, ["reward", "entropy (nats)"],
        "collapse lab v1 · solid: collapse onset · dotted: the entropy warning on entropy alone · "
        "dashed: with the reward (shipped)",
        path, 90,
    )  # fmt: skip


def rlwatch_rows(rows: list[dict[str, Any]], rundirs: list[Path]) -> list[dict[str, Any]]:
    """rlwatch 0.5.1's defaults on each run's step scalars (`v2.rlwatch_replay`, in its own
    virtualenv): the first step of its entropy detector's warning and critical alert, and of
    its first critical alert of any detector."""
    from benchmarks.collapse_lab.v2.evaluate import _rlwatch

    out = []
    for r, rundir in zip(rows, rundirs, strict=True):
        first = _rlwatch(rundir)["defaults"]
        out.append({
            "config": r["config"], "seed": r["seed"], "converged": r["converged"],
            "collapse_step": r["collapse_step"],
            "entropy_warning": first["first"].get("entropy_collapse:warning"),
            "entropy_critical": first["first"].get("entropy_collapse:critical"),
            "any_critical": first["first_critical"],
        })  # fmt: skip
    return out


def _step(x: int | None) -> str:
    return "–" if x is None else str(x)


def main(
    dirs: Annotated[list[Path], typer.Argument(help="lab v1 output folders (DIR/CONFIG-sSEED/)")],
    json_out: Annotated[Path | None, typer.Option("--json", help="write rows and decision")] = None,
    candidate: Annotated[Path, typer.Option(help="the candidate rules file")] = CANDIDATE,
    alert: Annotated[str, typer.Option(help="the candidate's alert")] = CANDIDATE_ALERT,
    rules: Annotated[
        Path, typer.Option(help="the rules the candidate is judged against (the shipped ones)")
    ] = RULES,
    plot_runs: Annotated[
        str, typer.Option("--plot", help="comma list of CONFIG-sSEED to plot")
    ] = "",
    plot_out: Annotated[Path, typer.Option(help="where --plot writes")] = Path("entropy.png"),
    rlwatch_json: Annotated[
        Path | None, typer.Option(help="run rlwatch's defaults on the runs, write them here")
    ] = None,
) -> None:
    """Print PROTOCOL-entropy.md's per-run table and the protocols' decisions."""
    runs = [(row(p.parent, candidate, alert, rules), p.parent) for d in dirs
            for p in d.glob("*/result.json")]  # fmt: skip
    runs.sort(key=lambda run: (run[0]["config"], run[0]["seed"]))
    rows, found = [r for r, _ in runs], [rundir for _, rundir in runs]
    print("| run | collapse step | last-20 reward | converged | shipped fires | candidate fires |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} s{r['seed']} | {_step(r['collapse_step'])} | "
            f"{r['reward_last20']:.3g} | {'yes' if r['converged'] else 'no'} | "
            f"{_step(r['shipped'])} | {_step(r['candidate'])} |"
        )
    print("\nthe reward where the shipped rule fired: gain on the first 20 steps; change over 20")
    for name, group in zip(("converged", "collapsed"), _groups(rows), strict=True):
        fired = [r for r in group if r["shipped"] is not None]
        if fired:
            gains = [r["reward_gain_at_shipped"] for r in fired]
            changes = [r["reward_change20_at_shipped"] for r in fired]
            median = statistics.median(gains)
            print(
                f"{name} ({len(fired)}): gain {min(gains):.1f}–{max(gains):.1f}× (median "
                f"{median:.1f}), change {min(changes):+.2f} to {max(changes):+.2f}"
            )
    decision = decide(rows)
    state = decide_state(rows)
    print("PROTOCOL-entropy.md:", json.dumps(decision, indent=1))
    print("PROTOCOL-entropy2.md and -entropy3.md:", json.dumps(state, indent=1))
    if json_out is not None:
        out = {"rows": rows, "decision": decision, "decision_state": state}
        json_out.write_text(json.dumps(out, indent=1) + "\n")
    if rlwatch_json is not None:
        rl = rlwatch_rows(rows, found)
        converged, collapsed = _groups(rl)
        fired = ("entropy_warning", "entropy_critical", "any_critical")
        for name, group in (("converged", converged), ("collapsed", collapsed), ("all", rl)):
            counts = {k: sum(r[k] is not None for r in group) for k in fired}
            print(f"rlwatch defaults on the {len(group)} {name} runs: {counts}")
        rlwatch_json.write_text(json.dumps(rl, indent=1) + "\n")
    if plot_runs:
        by_name = {rundir.name: rundir for rundir in found}
        plot(rows, [by_name[n.strip()] for n in plot_runs.split(",")], plot_out)


if __name__ == "__main__":
    typer.run(main)
