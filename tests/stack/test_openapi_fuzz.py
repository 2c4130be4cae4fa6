"""schemathesis against a live ``timwatch serve``: every operation of the OpenAPI document,
bounded examples, a fixed seed (CI stays deterministic), on SQLite and PostgreSQL.

It runs every check schemathesis has except ``positive_data_acceptance``: a packed batch has
constraints JSON Schema cannot state (every per-token array as long as ``logp_rollout``,
``cu_seqlens`` ending at that length), so a schema-valid random batch is usually, and rightly,
refused. ``negative_data_rejection`` stays on: whatever the schema refuses the server refuses.

schemathesis lives in its own virtualenv (``scripts/test.sh`` builds ``.venv-fuzz`` and sets
``TIMWATCH_SCHEMATHESIS``): grafana-client's niquests brings urllib3-future, which replaces
urllib3 in the environment it is installed in and breaks schemathesis's requests transport.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEED = "20261201"


def _st() -> str:
    exe = os.environ.get("TIMWATCH_SCHEMATHESIS") or shutil.which("st")
    local = ROOT / ".venv-fuzz" / "bin" / "st"
    if not exe and local.exists():
        exe = str(local)
    if not exe:
        pytest.fail("schemathesis not found: scripts/test.sh builds .venv-fuzz (CI must fuzz)")
    return exe


def _fuzz(url: str, tmp_path: Path, examples: int, *extra: str) -> None:
    report = tmp_path / "schemathesis.txt"
    cmd = [
        _st(), "--no-color", "run", f"{url}/openapi.json",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", str(examples), "--seed", SEED,
        # a slow answer on a loaded 2-core machine is not an API defect; a hang still is
        "--request-timeout", "60", "--max-response-time", "60", *extra,
    ]  # fmt: skip
    env = {**os.environ, "NO_COLOR": "1"}
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env, check=False
    )
    report.write_text(done.stdout + done.stderr)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-80:])
    assert done.returncode == 0, f"schemathesis found problems:\n{tail}"
    assert "Tested: 0" not in done.stdout, tail


@pytest.mark.timeout(660)  # the schemathesis subprocess has 600 s; a loaded CI box needs them
def test_schemathesis_sqlite(server_factory: Any, tmp_path: Path) -> None:
    srv = server_factory()
    _fuzz(srv.url, tmp_path, examples=25)
    assert "Traceback" not in srv.output()


@pytest.mark.timeout(660)  # the schemathesis subprocess has 600 s; a loaded CI box needs them
def test_schemathesis_postgres(server_factory: Any, pg_url: str, tmp_path: Path) -> None:
    srv = server_factory(db=pg_url)
    _fuzz(srv.url, tmp_path, 10)
    assert "Traceback" not in srv.output()


@pytest.mark.timeout(660)  # the schemathesis subprocess has 600 s; a loaded CI box needs them
def test_schemathesis_with_tokens_set_and_none_sent(server_factory: Any, tmp_path: Path) -> None:
    """Every operation but /healthz answers 401 without credentials: documented everywhere."""
    srv = server_factory(env={"TIMWATCH_TOKEN": "w-secret", "TIMWATCH_READ_TOKEN": "r-secret"})
    # no coverage phase: its boundary values (~50 s of generation) all meet the same 401
    _fuzz(srv.url, tmp_path, 5, "--phases", "examples,fuzzing,stateful")
    assert "Traceback" not in srv.output()
