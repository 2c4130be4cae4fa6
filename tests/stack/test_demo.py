"""`timwatch demo` end to end: subprocesses through the CLI, their history read back through a
real `timwatch serve` started from the demo's own hint, Ctrl-C in the middle of a run, and the
``--hold`` hints pasted into a shell while the demo serves.

The demo's mismatch comes from two numeric paths (KV-cache decode in the engine's precision vs an
fp32 prefill), so an fp32 engine must show a far smaller mismatch than a bf16 one, and with a lag
the history must show the staleness the demo really had.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.procs import REPO, free_port, running_process
from timwatch.monitor.store import Store

SMALL = ["--steps", "20", "--batch", "8", "--max-new-tokens", "16", "--no-live"]
PROG = f"{shlex.quote(sys.executable)} -m timwatch"


def cli() -> list[str]:
    return [sys.executable, "-m", "timwatch", "demo"]


def demo_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.pop("TIMWATCH_TOKEN", None)
    env.pop("TIMWATCH_URL", None)
    return env


def run_demo(db: str, run: str, *args: str) -> str:
    proc = subprocess.run(
        [*cli(), "--db", db, "--run", run, *SMALL, *args],
        cwd=REPO, env=demo_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def hint(out: str, label: str) -> str:
    """The command after ``label`` on its hint line (hints are never wrapped)."""
    m = re.search(rf"^  {re.escape(label)} +(\S.*)$", out, re.M)
    assert m, f"no {label!r} hint in:\n{out}"
    return m.group(1)


def series(url: str, run: str, names: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/runs/{run}/metrics", params={"names": names}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


class DemoProc:
    """A running demo whose merged stdout/stderr is collected line by line by a thread."""

    def __init__(self, args: list[str]) -> None:
        # a shell's background jobs ignore SIGINT and children inherit that; a user's terminal
        # does not, so the demo gets the default disposition here, as it would there
        self.proc = subprocess.Popen(
            args, cwd=REPO, env=demo_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text(), re.M):
            assert self.proc.poll() is None, f"demo exited {self.proc.returncode}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.text()}"
            time.sleep(0.1)

    def finish(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(10)
        return rc


@contextmanager
def demo_proc(*args: str) -> Iterator[DemoProc]:
    p = DemoProc([*cli(), *args])
    try:
        yield p
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(10)


def test_demo_mismatch_is_real_fp32_far_below_bf16_and_lag_shows(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'demo.db'}"
    out = run_demo(db, "d-bf16", "--precision", "bf16", "--lag", "0")
    assert "Traceback" not in out
    assert re.search(
        r"^step +0  reward \S+  ✓ healthy \(k3 \S+, engine at bf16 level\)$", out, re.M
    )
    assert "Summary  20 of 20 steps stored" in out
    assert f"history      run d-bf16 in {tmp_path / 'demo.db'}" in out
    run_demo(db, "d-fp32", "--precision", "fp32", "--lag", "0")
    lag_out = run_demo(db, "d-lag", "--precision", "bf16", "--lag", "2", "--steps", "6")
    assert "staleness dominates: lag 2" in lag_out

    # the demo's own hints, pasted: serve its history (on a free port), then query it
    serve = hint(out, "serve")
    assert serve == f"{PROG} serve --db sqlite:///{tmp_path / 'demo.db'}"
    url = f"http://127.0.0.1:{free_port()}"
    port = url.rsplit(":", 1)[1]
    with running_process([*shlex.split(serve)[1:], "--port", port], f"{url}/healthz"):
        query = subprocess.run(
            shlex.split(hint(out, "query")), cwd=tmp_path, capture_output=True, text=True,
            env=dict(demo_env(), TIMWATCH_URL=url), timeout=60,
        )  # fmt: skip
        assert query.returncode == 0, query.stdout + query.stderr
        assert "mismatch_kl" in query.stdout and "│ 19 " in query.stdout

        names = "mismatch_kl,discrepancy_kl,staleness_kl,version_lag_max,entropy_mean,tokens"
        bf16 = series(url, "d-bf16", names)
        fp32 = series(url, "d-fp32", names)
        lagged = series(url, "d-lag", names)
    assert bf16["steps"] == fp32["steps"] == list(range(20))
    b, f = bf16["series"], fp32["series"]
    assert all(v > 0 for v in b["mismatch_kl"])
    # no lag: the trainer's current weights are the engine's, so the mismatch is all engine
    assert b["staleness_kl"] == [0.0] * 20 and b["version_lag_max"] == [0] * 20
    assert max(f["mismatch_kl"]) < min(b["mismatch_kl"])
    assert sum(f["mismatch_kl"]) * 100 < sum(b["mismatch_kl"])
    assert all(0.01 < h < 5.6 for h in b["entropy_mean"])

    s = lagged["series"]
    assert lagged["steps"] == list(range(6))
    assert s["version_lag_max"] == [0, 1, 2, 2, 2, 2]
    assert all(v > 0 for v in s["staleness_kl"][1:])  # the trainer is ahead of the engine
    assert all(v > 0 for v in s["discrepancy_kl"])


def test_ctrl_c_stops_after_whole_steps_and_prints_the_summary(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'int.db'}"
    with demo_proc("--db", db, "--run", "d-int", *SMALL, "--steps", "100000") as p:
        p.wait_for(r"^step +1  reward ")
        p.proc.send_signal(signal.SIGINT)
        rc = p.finish()
    out = p.text()
    assert rc == 130, out
    assert "Traceback" not in out
    m = re.search(r"^Summary \(interrupted\)  (\d+) of 100000 steps stored", out, re.M)
    assert m, out
    done = int(m.group(1))
    assert done >= 2
    assert re.search(r"^  worst step   \d+ [✓!✗] ", out, re.M)
    assert f"history      run d-int in {tmp_path / 'int.db'}" in out
    # what the summary counts is what the history holds, step by step without a gap
    store = Store(db)
    try:
        steps, _ = store.query_metrics("d-int", ["mismatch_kl"])
    finally:
        store.close()
    assert steps == list(range(done))
    for k in range(done):
        assert re.search(rf"^step +{k}  reward ", out, re.M), k


def test_hold_prints_hints_that_work_while_it_serves(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'hold.db'}"
    args = ["--db", db, "--run", "d-hold", *SMALL, "--steps", "3", "--lag", "1", "--hold"]
    with demo_proc(*args) as p:
        p.wait_for(r"Ctrl-C to stop")
        out = p.text()
        worst = re.search(r"^  worst step   (\d+) ", out, re.M)
        assert worst, out

        def sh(label: str) -> str:
            r = subprocess.run(
                ["bash", "-c", hint(out, label)], cwd=tmp_path, env=demo_env(),
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert r.returncode == 0, f"{label}: {r.stdout}{r.stderr}"
            return r.stdout

        assert 'timwatch_token_kl_count{run="d-hold"}' in sh("Prometheus")
        assert '"steps":[0,1,2]' in sh("history API")
        assert f'"step":{worst.group(1)},' in sh("step API")
        assert hint(out, "history CLI").startswith(f"{PROG} query d-hold ")
        assert re.search(r"│ 2 +│", sh("history CLI"))
        assert f"step {worst.group(1)}" in sh("step CLI")
        p.proc.send_signal(signal.SIGINT)
        rc = p.finish()
    out = p.text()
    assert rc == 0, out
    assert "stopped serving" in out and "Traceback" not in out
