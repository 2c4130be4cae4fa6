"""The labelled-run generator end to end, small: real demo RL runs (tiny LM, bf16/fp16/fp32
engine, lag, injected token-id drift) through the real service and store, each diagnosed from
its history. Bounded: one subprocess with a 90 s limit (about 15 s here). Every labelled run
must rank its cause first and above FIRES, the healthy run must fire nothing, and the fp16 run
(the fix for bf16) must rank precision first *below* FIRES: its residual is what FP16 leaves.
The full table (24 steps, three seeds) is in docs/diagnosis.md."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.procs import REPO
from timwatch.monitor.diagnosis import FIRES

SCRIPT = REPO / "benchmarks" / "diagnosis_runs.py"


def test_small_labelled_runs_rank_their_cause_first() -> None:
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "12", "--batch", "8", "--max-new-tokens", "12",
         "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    results = {r["scenario"]: r for r in json.loads(p.stdout)}
    for name in ("precision-bf16", "staleness-fp32", "staleness-bf16", "tokenization"):
        cause, score = results[name]["ranked"][0]
        assert cause == results[name]["label"] and score >= FIRES, results[name]["ranked"]
    assert all(s < FIRES for _, s in results["healthy-fp32"]["ranked"])
    fp16 = results["precision-fp16"]["ranked"]
    assert fp16[0][0] == "precision" and 0 < fp16[0][1] < FIRES, fp16
    # the probe run was sent and read: decode vs prefill is checked, and says decode ≈ prefill
    bf16 = results["precision-bf16"]
    assert "decode ≈ prefill" in bf16["verdicts"]["decode_vs_prefill"]
    ratio = bf16["means"]["mismatch_kl"] / results["precision-fp16"]["means"]["mismatch_kl"]
    assert ratio > 10  # bf16 rounding vs fp16: the demo measures ~60-130x
