"""The labelled-run generator end to end, small: real demo RL runs (tiny LM, bf16/fp32 engine,
lag, injected token-id drift) through the real service and store, diagnosed from their history.
Bounded: a subprocess with a 90 s limit. The runs whose cause is an exact observation
(token ids that differ) or dominates by orders of magnitude (lag 3 on an fp32 engine) must rank
it first; the table of all scenarios is in docs/diagnosis.md."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.procs import REPO

SCRIPT = REPO / "benchmarks" / "diagnosis_runs.py"


def test_small_labelled_runs_rank_their_cause_first() -> None:
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "8", "--batch", "8", "--max-new-tokens", "12",
         "--only", "tokenization,staleness-fp32,precision-bf16", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    results = {r["scenario"]: r for r in json.loads(p.stdout)}
    assert set(results) == {"tokenization", "staleness-fp32", "precision-bf16"}
    assert results["tokenization"]["ranked"][0][0] == "tokenization"
    assert results["staleness-fp32"]["ranked"][0][0] == "staleness"
    bf16 = results["precision-bf16"]
    # the probe run was sent and read: decode vs prefill is checked, not skipped
    assert "decode_vs_prefill" in {c for c, _ in bf16["ranked"]}
    assert (
        bf16["means"]["discrepancy_kl"] > 10 * results["staleness-fp32"]["means"]["discrepancy_kl"]
    )
