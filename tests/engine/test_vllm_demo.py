"""``timwatch demo --engine vllm`` end to end through the CLI: the demo builds the tiny Llama,
starts a real vLLM (bf16), trains in fp32 torch and has vLLM reload every new version while
rollouts are in flight; its history must show what only a real asynchronous engine produces:
tokens older than the trainer (lag ≥ 1, staleness), a version switch inside sequences, the bf16
engine's own mismatch, and every step stored."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.procs import REPO
from tests.helpers.vllm import Engines
from timwatch.monitor.store import Store

pytestmark = pytest.mark.timeout(1200)  # one vLLM start on a busy 2-core machine

STEPS = 6
NAMES = [
    "policy_version", "version_lag_max", "intra_switch_ratio", "staleness_kl",
    "discrepancy_kl", "token_id_mismatch_ratio", "tokens",
]  # fmt: skip


def test_demo_on_vllm_shows_real_versions_and_staleness(
    vllm_python: str, engines: Engines, tmp_path: Path
) -> None:
    engines.stop()  # the demo starts its own vLLM, which waits for the machine-wide lock
    db = f"sqlite:///{tmp_path / 'demo.db'}"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env["TIMWATCH_VLLM_PYTHON"] = vllm_python
    env.pop("TIMWATCH_TOKEN", None)
    proc = subprocess.run(
        [sys.executable, "-m", "timwatch", "demo", "--engine", "vllm", "--db", db,
         "--run", "dv", "--steps", str(STEPS), "--batch", "4", "--max-new-tokens", "32",
         "--no-live"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1100,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"Summary  {STEPS} of {STEPS} steps stored" in out
    assert "vLLM bfloat16 on http://127.0.0.1:" in out
    store = Store(db)
    try:
        steps, s = store.query_metrics("dv", NAMES)
    finally:
        store.close()
    assert steps == list(range(STEPS))
    assert s["policy_version"] == steps
    assert s["token_id_mismatch_ratio"] == [0.0] * STEPS
    assert all(n > 0 for n in s["tokens"])
    # rollouts run while the trainer moves on: some tokens are a version (or more) behind,
    # and the trainer's weights differ from theirs
    lagged = [k for k in steps if s["version_lag_max"][k] >= 1]
    assert lagged, s["version_lag_max"]
    assert all(s["staleness_kl"][k] > 0 for k in lagged)
    assert max(s["version_lag_max"]) <= 4
    # a reload while requests are in flight: sequences whose tokens carry two versions
    assert max(s["intra_switch_ratio"]) > 0
    # the bf16 engine against the fp32 recompute under each token's own weights
    assert all(v > 0 for v in s["discrepancy_kl"])
