"""A server installed without the ``[report]`` extra: every route but the report page works,
the page answers 501 naming the extra, and ``timwatch report --html`` says so in one line.

The server is a real ``timwatch serve`` whose interpreter lacks matplotlib the way the import
system marks a missing module (``sys.modules["matplotlib"] = None``, set by a sitecustomize
ahead of the repo on its PYTHONPATH)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.helpers.batches import random_batch
from tests.helpers.procs import REPO, ServerProc
from tests.helpers.wire import as_batch
from timwatch.monitor.client import TimwatchClient

HINT = "the incident report needs the [report] extra: pip install 'timwatch[report]' on the server"


def test_report_page_names_the_missing_report_extra(
    server_factory: Callable[..., ServerProc], tmp_path: Path
) -> None:
    site = tmp_path / "no-matplotlib"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\n\nsys.modules['matplotlib'] = None\n")
    srv = server_factory(env={"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])})
    with TimwatchClient(srv.url) as c:
        raw = random_batch(np.random.default_rng(0), n_seq=4)
        c.ingest("no-report", as_batch(dataclasses.replace(raw, step=0, batch_id="b0")))
    with srv.client() as c:
        assert c.get("/v1/runs/no-report/diagnosis").status_code == 200
        page = c.get("/v1/runs/no-report/report.html")
        assert (page.status_code, page.json()["detail"]) == (501, HINT)
    out = tmp_path / "report.html"
    proc = subprocess.run(
        [sys.executable, "-m", "timwatch", "report", "no-report", "--html", str(out),
         "--url", srv.url],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and HINT in lines[0], proc.stderr
    assert not out.exists()
