"""A real `timwatch serve` subprocess for the lab, and the per-step snapshot of what it exports.

After each step the lab flushes the tap and reads /metrics; `snapshot` keeps the run's samples of
the additive families the shipped rules read (counters, summary `_sum`/`_count`, histogram
buckets) and the trainer's step scalars (``timwatch_scalar_*`` gauges, the step's values). Other
gauges are left out: the replay maps steps onto a synthetic clock, on which a Unix-time gauge
(`timwatch_last_batch_timestamp_seconds`) means nothing, so TimwatchIngestStalled is not
replayed.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

__all__ = ["FAMILIES", "SCALARS", "LabServer", "snapshot"]

FAMILIES = (
    "timwatch_token_kl_sum", "timwatch_token_kl_count",
    "timwatch_token_is_ratio_sum", "timwatch_token_is_ratio_count",
    "timwatch_token_is_ratio_squared_sum", "timwatch_token_is_ratio_squared_count",
    "timwatch_token_entropy_sum", "timwatch_token_entropy_count",
    "timwatch_token_log_ratio_squared_sum", "timwatch_tokens_total",
    "timwatch_masked_tokens_total", "timwatch_batches_total",
    "timwatch_token_id_mismatched_tokens_total", "timwatch_token_id_checked_tokens_total",
    "timwatch_token_version_lag_bucket",
)  # fmt: skip
# the trainer's step scalars (`Tap.log`), gauges holding the step's value: replayed as they are
SCALARS = "timwatch_scalar_"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LabServer:
    """`timwatch serve` on 127.0.0.1 with a SQLite history under ``workdir``; `stop` ends it."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.log = open(workdir / "serve.log", "wb")  # noqa: SIM115 (closed in stop)
        cmd = [
            sys.executable, "-m", "timwatch", "serve", "--port", str(self.port),
            "--db", f"sqlite:///{workdir / 'history.db'}", "--log-level", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"timwatch serve did not start (log: {workdir / 'serve.log'})")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def snapshot(text: str, run: str) -> dict[str, float]:
    """``{series: value}`` of ``run``'s samples in the families the rules read."""
    out: dict[str, float] = {}
    tag = f'run="{run}"'
    for line in text.splitlines():
        m = _LINE.match(line)
        name = m.group(1) if m else ""
        if m and (name in FAMILIES or name.startswith(SCALARS)) and tag in (m.group(2) or ""):
            out[m.group(1) + m.group(2)] = float(m.group(3))
    return out
