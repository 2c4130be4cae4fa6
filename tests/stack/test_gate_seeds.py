"""With no real difference the gate passes: 20 demo runs (bf16 engine copy, lag 0, 20 steps;
the demo's real RL loop, `tests.helpers.demo_batches`) on seeds 1–20, each gated against a
baseline written by ``timwatch gate --write-baseline`` from five runs of the same settings on
seeds 21–25. The seed changes the model's initial weights, the prompts and the samples, so this
is the run-to-run spread a CI job sees, not only step-to-step noise; the five baseline runs
carry that spread into the limit. 20 of 20 must pass (about a minute on a busy 2-core machine;
``pytest -s`` prints the worst candidate's share of its limit, and what a baseline of one run,
seed 21, would have let through)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.demo_batches import write_demo_run
from tests.helpers.procs import REPO
from timwatch.monitor.compare import Baseline, gate, load_batch_dir
from timwatch.monitor.compare.gate import make_baseline

STEPS = 20
SEEDS = range(1, 21)
BASE_SEEDS = range(21, 26)


def test_gate_passes_20_of_20_seeds_with_no_real_difference(tmp_path: Path) -> None:
    base = [f"b{seed}" for seed in BASE_SEEDS]
    for name, seed in zip(base, BASE_SEEDS, strict=True):
        write_demo_run(tmp_path, name, seed=seed, steps=STEPS, precision="bf16", lag=0)
    path = tmp_path / "baseline.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(
        [sys.executable, "-m", "timwatch", "gate", *base, "--batches", str(tmp_path),
         "--write-baseline", str(path), "--model", "tiny-lm", "--engine", "embedded-bf16"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    baseline = Baseline.load(path)
    assert set(baseline.metrics) >= {"mismatch_kl", "seq_log_ratio_abs_mean"}
    assert baseline.run == ", ".join(base) and baseline.metrics["mismatch_kl"].runs == 5
    one = make_baseline(load_batch_dir(tmp_path, base[0]), model="tiny-lm", engine="e")
    failed, worst, failed_one = [], 0.0, []
    for seed in SEEDS:
        write_demo_run(tmp_path, f"s{seed}", seed=seed, steps=STEPS, precision="bf16", lag=0)
        run = load_batch_dir(tmp_path, f"s{seed}")
        res = gate(run, baseline, engine="embedded-bf16")
        if not res.passed:
            failed.append(seed)
        if not gate(run, one).passed:
            failed_one.append(seed)
        worst = max([worst, *(c.mean / c.limit for c in res.checks if c.limit > 0)])
    passed = len(SEEDS) - len(failed)
    print(f"\n{passed} of {len(SEEDS)} seeds pass; worst candidate/limit {worst:.2f}; "
          f"against seed 21 alone {len(SEEDS) - len(failed_one)} pass")  # fmt: skip
    assert failed == [], f"seeds {failed} failed; worst candidate/limit {worst:.2f}"
    # the runs differ for real (the gate is not passing everything): a bf16 candidate is far
    # above an fp32 baseline from the same seed
    write_demo_run(tmp_path, "fp32", seed=0, steps=STEPS, precision="fp32", lag=0)
    fp32 = make_baseline(load_batch_dir(tmp_path, "fp32"), model="tiny-lm", engine="e")
    bad = gate(load_batch_dir(tmp_path, "s1"), fp32)
    print("bf16 against fp32: " + ", ".join(f"{c.metric} {c.mean / c.limit:.2g}× its limit"
                                            for c in bad.checks if c.limit > 0))  # fmt: skip
    assert not bad.passed
