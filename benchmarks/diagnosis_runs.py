"""Labelled runs for `timwatch diagnose`: runs with a known dominant cause, made by the demo's
real RL loop (`timwatch.sidecar.demo.train.DemoTrainer`: a tiny LM, its rollout engine in
``precision`` with weights ``lag`` versions old, an fp32 trainer), each diagnosed from the
history it left; prints the metrics each run measured and the accuracy table (cause → top-1 /
top-2 hits). The causes come from engine settings that real engines have, not from writing the
metrics: bf16/fp16 weights, a lag, rotary angles computed in bf16 (``rope_dtype``), an fp8 decode
KV cache (``kv_dtype``), a distillation teacher whose temperature is annealed
(``teacher_decay``). Only the ``tokenization`` scenario injects a bug (``token_drift``: a share
of response tokens reaches the trainer as another id, a round trip that does not hold).

The label ``none`` is a run with no cause: it is a hit when no cause scores at least
`timwatch.monitor.diagnosis.FIRES`. Everything runs in this process (the service on loopback,
SQLite in a temporary directory) and is bounded by ``--steps`` (24 steps take 5-30 s per
scenario on one core).

    python benchmarks/diagnosis_runs.py [--steps 24] [--batch 16] [--max-new-tokens 24]
        [--only precision-bf16,staleness-fp32] [--repeats 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timwatch.monitor.diagnosis import FIRES, PROBE_SUFFIX, diagnose_run  # noqa: E402

__all__ = ["SCENARIOS", "Scenario", "main", "run_scenarios"]

#: the columns printed per run (what the thresholds of docs/diagnosis.md were read from)
SHOWN = (
    "mismatch_kl",
    "discrepancy_kl",
    "staleness_kl",
    "noise_scale",
    "entropy_delta_corr",
    "entropy_mean",
    "token_id_mismatch_ratio",
    "teacher_hard_ratio",
)

#: the columns whose late/early trend is printed
TRENDS = ("mismatch_kl", "entropy_mean", "noise_scale", "teacher_hard_ratio")


@dataclass(frozen=True)
class Scenario:
    name: str
    label: str  # the dominant cause (``none``: healthy)
    what: str
    train: dict[str, Any] = field(default_factory=dict)
    #: also send prefill probes (engine decode μ vs one prefill pass of the same engine) to
    #: ``<run>-prefill-probe``, as the SGLang sidecar does
    probe: bool = False


SCENARIOS = (
    Scenario(
        "precision-bf16",
        "precision",
        "bf16 engine, lag 0, prefill probes",
        {"precision": "bf16", "lag": 0},
        probe=True,
    ),  # fmt: skip
    Scenario("precision-fp16", "precision", "fp16 engine, lag 0", {"precision": "fp16", "lag": 0}),
    Scenario("staleness-fp32", "staleness", "fp32 engine, lag 3", {"precision": "fp32", "lag": 3}),
    Scenario("staleness-bf16", "staleness", "bf16 engine, lag 4", {"precision": "bf16", "lag": 4}),
    Scenario(
        "tokenization",
        "tokenization",
        "fp32 engine, lag 0, 2 % of ids drift",
        {"precision": "fp32", "lag": 0, "token_drift": 0.02},
    ),  # fmt: skip
    Scenario(
        "length-rope",
        "length",
        "fp32 engine computing its rotary angles in bf16, lag 0, 32 responses of 2-64 tokens",
        # its own lengths and batch: enough short and long responses for the length buckets
        # (≥ 64 tokens each) however small the run
        {
            "precision": "fp32",
            "lag": 0,
            "rope_dtype": "bf16",
            "min_new_tokens": 2,
            "max_new_tokens": 64,
            "batch": 32,
        },
    ),  # fmt: skip  # fmt: skip
    Scenario(
        "decode-kv-fp8",
        "decode_vs_prefill",
        "fp32 engine with an fp8 (e4m3) decode KV cache, lag 0, prefill probes",
        {"precision": "fp32", "lag": 0, "kv_dtype": "fp8"},
        probe=True,
    ),  # fmt: skip
    Scenario(
        "teacher-anneal",
        "teacher_collapse",
        "fp32 engine, lag 0, distillation teacher's temperature annealed 0.7x per step",
        {"precision": "fp32", "lag": 0, "teacher_decay": 0.7},
    ),  # fmt: skip
    Scenario(
        "teacher-steady",
        "none",
        "fp32 engine, lag 0, distillation teacher at a constant temperature 1",
        {"precision": "fp32", "lag": 0, "teacher_decay": 1.0},
    ),  # fmt: skip
    Scenario("healthy-fp32", "none", "fp32 engine, lag 0", {"precision": "fp32", "lag": 0}),
)


def _probe(trainer: Any, captured: dict[str, Any], step: int, tap: Any) -> None:
    """One prefill pass of the engine (its dtype, same weights) over the rollout just sampled;
    μ from decode vs the prefill's log-probs, shipped like the sidecar's probes."""
    import torch

    from timwatch.monitor.trainer.logprobs import logprobs_and_entropy_from_logits
    from timwatch.sidecar.demo.train import PROMPT_LEN

    roll, prompt = captured["roll"], captured["prompt"]
    full = torch.cat([prompt, roll.tokens], dim=1)
    with torch.no_grad():
        logits = trainer.engine(full)[:, PROMPT_LEN - 1 : -1].float()
        lp, h = logprobs_and_entropy_from_logits(logits, roll.tokens)
    b, t = roll.tokens.shape
    cu = torch.arange(0, b * t + 1, t, dtype=torch.int64)
    tap.report(
        step, cu_seqlens=cu, logp_rollout=roll.logp.reshape(-1), logp_train=lp.reshape(-1),
        entropy=h.reshape(-1), loss_mask=torch.ones(b * t, dtype=torch.int8),
        policy_version=step, entropy_source="rollout",
    )  # fmt: skip


def _one(service: Any, sc: Scenario, run: str, *, steps: int, common: dict[str, Any]) -> Any:
    from timwatch.sidecar.demo.train import DemoTrainer
    from timwatch.sidecar.tap import Tap

    trainer = DemoTrainer(**{**common, **sc.train})
    captured: dict[str, Any] = {}
    if sc.probe:
        generate = trainer.engine.generate

        def keep(prompt: Any, new: int, gen: Any) -> Any:
            captured["prompt"], captured["roll"] = prompt, generate(prompt, new, gen)
            return captured["roll"]

        trainer.engine.generate = keep  # type: ignore[method-assign,assignment]
    taps = [Tap(service.url, run, rank=0, finish=False)]
    if sc.probe:
        taps.append(Tap(service.url, f"{run}{PROBE_SUFFIX}", rank=0, finish=False))
    try:
        for step in range(steps):
            trainer.step(step, taps[0])
            if sc.probe:
                _probe(trainer, captured, step, taps[1])
        for tap in taps:
            if not tap.flush(120):
                raise RuntimeError(f"{tap.run}: the tap did not deliver every batch")
    finally:
        for tap in taps:
            tap.close(10)
    return diagnose_run(service.store, run)


def run_scenarios(
    *, steps: int = 24, batch: int = 16, max_new_tokens: int = 24, only: list[str] | None = None,
    repeats: int = 1, seed: int = 0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every chosen scenario ``repeats`` times (seeds ``seed``, ``seed + 1``, …): one dict per
    run with the label, the ranked causes, their scores and the run's metric means."""
    from timwatch.monitor.core.engine import warm_up
    from timwatch.sidecar.demo.service import DemoService

    chosen = [s for s in SCENARIOS if not only or s.name in only]
    if only and len(chosen) != len(set(only)):
        known = ", ".join(s.name for s in SCENARIOS)
        raise SystemExit(f"--only: unknown scenario in {only}; known: {known}")
    warm_up()
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        service = DemoService(f"sqlite:///{tmp}/diagnosis.db", 0)
        try:
            for r in range(repeats):
                for sc in chosen:
                    common = {
                        "precision": "bf16", "lag": 0, "batch": batch,
                        "max_new_tokens": max_new_tokens, "updates": 2, "lr": 3e-4,
                        "seed": seed + r, "threads": 1,
                    }  # fmt: skip
                    t = time.monotonic()
                    run = f"{sc.name}-s{seed + r}"
                    d = _one(service, sc, run, steps=steps, common=common).to_dict()
                    _, cols = service.store.query_series(run, SHOWN)
                    means = {n: _mean(cols[n]) for n in SHOWN}
                    trends = {n: _trend(cols[n]) for n in TRENDS}
                    signals = _signals(d, cols["teacher_hard_ratio"], means)
                    out.append({
                        "scenario": sc.name, "label": sc.label, "what": sc.what, "run": run,
                        "seconds": round(time.monotonic() - t, 1), "means": means, "trends": trends,
                        "signals": signals,
                        "verdicts": {c["cause"]: c["verdict"] for c in d["causes"]},
                        "ranked": [(c["cause"], c["score"]) for c in d["causes"]],
                        "not_checked": [n["cause"] for n in d["not_checked"]],
                    })  # fmt: skip
        finally:
            service.stop()
    return out


#: what the localising and teacher rules read, per run (docs/diagnosis.md quotes them)
SIGNALS = ("length ×/doubling", "probe share", "teacher_hard first → last third", "soft ×shrink")


def _signals(d: dict[str, Any], hard: Any, means: dict[str, Any]) -> dict[str, Any]:
    """k3 per token ×f per doubling of length (the length rule's fit), the probe run's share of
    the engine-only KL, and teacher_hard_ratio's first and last third with the soft share's
    shrink (the teacher rule's inputs)."""
    ev = {c["cause"]: c["evidence"] for c in d["causes"]}
    length = ev.get("length", [{}])[0].get("value")
    share = None
    if "decode_vs_prefill" in ev and means.get("discrepancy_kl"):
        share = ev["decode_vs_prefill"][0]["value"] / means["discrepancy_kl"]
    xs = [float(v) for v in hard if v is not None and float(v) == float(v)]
    first = last = shrink = None
    if len(xs) >= 3:
        k = max(1, len(xs) // 3)
        first, last = sum(xs[:k]) / k, sum(xs[-k:]) / k
        shrink = (1 - first) / max(1 - last, 1e-6)
    return {SIGNALS[0]: length, SIGNALS[1]: share, SIGNALS[2]: (first, last), SIGNALS[3]: shrink}


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        return "-" if v[0] is None else f"{v[0]:.3g} → {v[1]:.3g}"
    return "-" if v is None else f"{v:.3g}"


def _trend(values: Any) -> float | None:
    """Late/early: mean of the last third over the first third (as the rules read it)."""
    xs = [float(v) for v in values if v is not None and float(v) == float(v)]
    k = max(1, len(xs) // 3)
    if len(xs) < 3 or sum(xs[:k]) <= 0:
        return None
    return (sum(xs[-k:]) / k) / (sum(xs[:k]) / k)


def _mean(values: Any) -> float | None:
    xs = [float(v) for v in values if v is not None and float(v) == float(v)]
    return sum(xs) / len(xs) if xs else None


def hits(result: dict[str, Any]) -> tuple[bool, bool]:
    """(top-1 hit, top-2 hit) of one run: the label among the first one / two causes that
    score at least FIRES; for ``none``, no cause at FIRES counts as both."""
    fired = [c for c, s in result["ranked"] if s >= FIRES]
    if result["label"] == "none":
        return not fired, not fired
    return result["label"] in fired[:1], result["label"] in fired[:2]


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| run | label | what | top causes (score) | top-1 | top-2 |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        top = ", ".join(f"{c} {s:.2f}" for c, s in r["ranked"][:3])
        h1, h2 = hits(r)
        lines.append(
            f"| {r['run']} | {r['label']} | {r['what']} | {top} | {'✓' if h1 else '✗'} | "
            f"{'✓' if h2 else '✗'} |"
        )
    lines += ["", "| label | runs | top-1 | top-2 |", "|---|---|---|---|"]
    for label in dict.fromkeys(r["label"] for r in results):
        mine = [hits(r) for r in results if r["label"] == label]
        lines.append(
            f"| {label} | {len(mine)} | {sum(a for a, _ in mine)}/{len(mine)} | "
            f"{sum(b for _, b in mine)}/{len(mine)} |"
        )
    lines += ["", "| run | " + " | ".join(SHOWN) + " |", "|---|" + "---|" * len(SHOWN)]
    for r in results:
        vals = " | ".join("-" if r["means"][n] is None else f"{r['means'][n]:.3g}" for n in SHOWN)
        lines.append(f"| {r['run']} | {vals} |")
    lines += ["", "| run | " + " | ".join(f"{n} late/early" for n in TRENDS) + " |",
              "|---|" + "---|" * len(TRENDS)]  # fmt: skip
    for r in results:
        vals = " | ".join("-" if r["trends"][n] is None else f"{r['trends'][n]:.3g}"
                          for n in TRENDS)  # fmt: skip
        lines.append(f"| {r['run']} | {vals} |")
    lines += ["", "| run | " + " | ".join(SIGNALS) + " |", "|---|" + "---|" * len(SIGNALS)]
    for r in results:
        lines.append(f"| {r['run']} | " + " | ".join(_fmt(r["signals"][n]) for n in SIGNALS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    only = [s for s in a.only.split(",") if s] or None
    results = run_scenarios(
        steps=a.steps, batch=a.batch, max_new_tokens=a.max_new_tokens, only=only,
        repeats=a.repeats, seed=a.seed,
    )  # fmt: skip
    print(json.dumps(results, indent=1) if a.json else table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
