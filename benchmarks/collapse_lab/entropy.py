"""``python -m benchmarks.collapse_lab.entropy DIR… [--candidate FILE --alert NAME] [--json OUT]``:
PROTOCOL-entropy.md's table and the decisions of PROTOCOL-entropy.md (`decide`) and of
PROTOCOL-entropy2.md and PROTOCOL-entropy3.md (`decide_state`).

Every lab v1 run under ``DIR/*/`` (``result.json``, ``steps.jsonl``, ``series.jsonl``) is
replayed through the shipped rules together with a candidate file: lab v2's (its
`TimwatchEntropyCollapseCandidate` reads the run's reward scalars) unless ``--candidate`` names
another, such as `ENTROPY3` (`replay.cached_firings`, so an edited rule replays again). A run is
*converged* when it did not collapse and its last 20 steps' mean reward is at least
`CONVERGED_REWARD`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.collapse_lab.replay import CANDIDATE, RULES, cached_firings

SHIPPED_ALERT = "TimwatchEntropyCollapse"
CANDIDATE_ALERT = "TimwatchEntropyCollapseCandidate"
#: PROTOCOL-entropy3.md's candidate file and its alert
ENTROPY3 = Path(__file__).resolve().parent / "entropy3.rules.yml"
ENTROPY3_ALERT = "TimwatchEntropyCollapseCandidate3"
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


def row(rundir: Path, candidate: Path = CANDIDATE, alert: str = CANDIDATE_ALERT) -> dict[str, Any]:
    """One run: its outcome and the first step of the shipped and of the candidate rule."""
    result = json.loads((rundir / "result.json").read_text())
    firings = cached_firings(rundir, (RULES, candidate))
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


def _step(x: int | None) -> str:
    return "–" if x is None else str(x)


def main(
    dirs: Annotated[list[Path], typer.Argument(help="lab v1 output folders (DIR/CONFIG-sSEED/)")],
    json_out: Annotated[Path | None, typer.Option("--json", help="write rows and decision")] = None,
    candidate: Annotated[Path, typer.Option(help="the candidate rules file")] = CANDIDATE,
    alert: Annotated[str, typer.Option(help="the candidate's alert")] = CANDIDATE_ALERT,
) -> None:
    """Print PROTOCOL-entropy.md's per-run table and the protocols' decisions."""
    rows = [row(p.parent, candidate, alert) for d in dirs for p in sorted(d.glob("*/result.json"))]
    rows.sort(key=lambda r: (r["config"], r["seed"]))
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


if __name__ == "__main__":
    typer.run(main)
