"""`timwatch demo` end to end: a subprocess through the CLI, then its history read back through a
real `timwatch serve` on the SQLite file the demo wrote.

The demo's mismatch comes from two numeric paths (KV-cache decode in the engine's precision vs an
fp32 prefill), so an fp32 engine must show a far smaller mismatch than a bf16 one, and with a lag
the history must show the staleness the demo really had.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.procs import REPO

SMALL = ["--steps", "20", "--batch", "8", "--max-new-tokens", "16", "--no-live"]


def cli() -> list[str]:
    return [sys.executable, "-m", "timwatch", "demo"]


def run_demo(db: str, run: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TIMWATCH_TOKEN", None)
    proc = subprocess.run(
        [*cli(), "--db", db, "--run", run, *SMALL, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def series(srv: Any, run: str, names: str) -> dict[str, Any]:
    with srv.client() as c:
        r = c.get(f"/v1/runs/{run}/metrics", params={"names": names})
    assert r.status_code == 200, r.text
    return r.json()


def test_demo_mismatch_is_real_fp32_far_below_bf16_and_lag_shows(
    tmp_path: Path, server_factory: Any
) -> None:
    db = f"sqlite:///{tmp_path / 'demo.db'}"
    out = run_demo(db, "d-bf16", "--precision", "bf16", "--lag", "0")
    assert "timwatch query d-bf16 --metric mismatch_kl" in out
    assert "/metrics" in out
    run_demo(db, "d-fp32", "--precision", "fp32", "--lag", "0")
    run_demo(db, "d-lag", "--precision", "bf16", "--lag", "2", "--steps", "6")
    srv = server_factory(db=db)

    names = "mismatch_kl,discrepancy_kl,staleness_kl,version_lag_max,entropy_mean,tokens"
    bf16 = series(srv, "d-bf16", names)
    fp32 = series(srv, "d-fp32", names)
    assert bf16["steps"] == fp32["steps"] == list(range(20))
    b, f = bf16["series"], fp32["series"]
    assert all(v > 0 for v in b["mismatch_kl"])
    # no lag: the trainer's current weights are the engine's, so the mismatch is all engine
    assert b["staleness_kl"] == [0.0] * 20 and b["version_lag_max"] == [0] * 20
    assert max(f["mismatch_kl"]) < min(b["mismatch_kl"])
    assert sum(f["mismatch_kl"]) * 100 < sum(b["mismatch_kl"])
    assert all(0.01 < h < 5.6 for h in b["entropy_mean"])

    lagged = series(srv, "d-lag", names)
    s = lagged["series"]
    assert lagged["steps"] == list(range(6))
    assert s["version_lag_max"] == [0, 1, 2, 2, 2, 2]
    assert all(v > 0 for v in s["staleness_kl"][1:])  # the trainer is ahead of the engine
    assert all(v > 0 for v in s["discrepancy_kl"])
