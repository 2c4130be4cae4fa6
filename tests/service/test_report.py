"""The incident report served by a real ``timwatch serve`` and written by ``timwatch report
--html``, and its size on a 10k-step run (docs/service.md, "Incident report")."""

from __future__ import annotations

import dataclasses
import html
import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.batches import random_batch
from tests.helpers.cli import timwatch
from tests.helpers.procs import ServerProc
from tests.helpers.report_runs import ingest_steps
from tests.helpers.wire import as_batch
from timwatch.monitor.client import TimwatchClient
from timwatch.monitor.report import build_report
from timwatch.monitor.store import Store

WRITE, READ = "report-write", "report-read"
_GENERATED = re.compile(r"generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")


def _protected(server_factory: Callable[..., ServerProc]) -> ServerProc:
    srv = server_factory(env={"TIMWATCH_TOKEN": WRITE, "TIMWATCH_READ_TOKEN": READ}, token=WRITE)
    with TimwatchClient(srv.url, token=WRITE) as c:
        for s in range(6):
            raw = random_batch(np.random.default_rng(s), n_seq=6, optional="all")
            raw = dataclasses.replace(raw, step=s, batch_id=f"b{s}", policy_version=s + 2)
            c.ingest("rep-1", as_batch(raw), tags={"model": "<qwen>"})
    return srv


def test_report_is_served_read_protected_and_self_contained(
    server_factory: Callable[..., ServerProc],
) -> None:
    srv = _protected(server_factory)
    with srv.client(READ) as c:
        r = c.get("/v1/runs/rep-1/report.html")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/html")
        page = r.text
        assert page.startswith("<!DOCTYPE html>") and "rep-1" in page
        assert "model=&lt;qwen&gt;" in page and "<qwen>" not in page
        assert page.count('src="data:image/png;base64,') == 8
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
        assert "6 steps, steps 0–5" in page
        diag = c.get("/v1/runs/rep-1/diagnosis").json()  # the page shows the same diagnosis
        assert "diagnosis not available" not in page and "diagnosis failed" not in page
        for cause in diag["causes"] + diag["not_checked"]:
            assert html.escape(cause["cause"]) in page
        ranged = c.get("/v1/runs/rep-1/report.html", params={"from_step": 2, "to_step": 3})
        assert ranged.status_code == 200 and "2 steps, steps 2–3" in ranged.text
        assert "merged over 2 step(s), 2–3" in ranged.text
        assert c.get("/v1/runs/nope/report.html").status_code == 404
        assert c.get("/v1/runs/bad%20id/report.html").status_code == 404
        bad = c.get("/v1/runs/rep-1/report.html", params={"from_step": 4, "to_step": 1})
        assert bad.status_code == 422 and "from_step 4 is after to_step 1" in bad.json()["detail"]
        assert c.get("/v1/runs/rep-1/report.html", params={"from_step": -1}).status_code == 422
    with srv.client("") as anon:
        assert anon.get("/v1/runs/rep-1/report.html").status_code == 401
    spec = srv.client(READ).get("/openapi.json").json()
    op = spec["paths"]["/v1/runs/{run}/report.html"]["get"]
    assert set(op["responses"]) == {"200", "401", "404", "422", "503"}
    assert "text/html" in op["responses"]["200"]["content"]


def test_report_shows_token_text_from_the_services_tokenizer(
    server_factory: Callable[..., ServerProc], tmp_path: Path
) -> None:
    """``timwatch serve --tokenizer FILE``: the worst tokens carry their text, escaped (every
    piece here is markup), in the served page and so in the file the CLI writes from it."""
    vocab = {f"<b>t{i}</b>": i for i in range(150_000)}  # random_batch draws ids below 150k
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab},
                               "decoder": {"type": "ByteLevel"}}))  # fmt: skip
    srv = server_factory(args=["--tokenizer", str(tok)])
    with TimwatchClient(srv.url) as c:
        raw = random_batch(np.random.default_rng(3), n_seq=6, optional="all")
        c.ingest("tok-1", as_batch(dataclasses.replace(raw, step=0, batch_id="b0")))
        page = c.http.get("/v1/runs/tok-1/report.html").text
    worst = page.split('id="worst"')[1]
    ids = re.findall(r'<td class="n">(\d+)</td><td><code>', worst)
    assert len(ids) >= 5, worst[:2000]
    for i in ids:
        assert f"<td><code>&#x27;&lt;b&gt;t{i}&lt;/b&gt;&#x27;</code></td>" in worst
    assert "<b>t" not in page and "--tokenizer file" in page


def test_cli_writes_the_served_page(
    server_factory: Callable[..., ServerProc], tmp_path: Path
) -> None:
    srv = _protected(server_factory)
    out = tmp_path / "report.html"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return timwatch("report", *args, "--url", srv.url, "--token", READ)

    p = cli("rep-1", "--html", str(out), "--from-step", "1", "--to-step", "4")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"wrote {out}" in p.stdout
    written = out.read_text(encoding="utf-8")
    served = srv.client(READ).get(
        "/v1/runs/rep-1/report.html", params={"from_step": 1, "to_step": 4}
    )
    assert _GENERATED.sub("", written) == _GENERATED.sub("", served.text)
    table = cli("rep-1")  # the table output stays
    assert table.returncode == 0 and "mismatch_kl" in table.stdout and "<html" not in table.stdout
    missing = cli("nope", "--html", str(tmp_path / "x.html"))
    assert missing.returncode != 0 and "not found" in missing.stdout + missing.stderr
    assert not (tmp_path / "x.html").exists()
    unwritable = cli("rep-1", "--html", str(tmp_path / "no-dir" / "x.html"))
    assert unwritable.returncode != 0 and "cannot write --html" in unwritable.stdout + (
        unwritable.stderr
    )
    lone = cli("rep-1", "--from-step", "2")
    assert lone.returncode != 0 and "go with --html" in lone.stdout + lone.stderr


@pytest.mark.slow  # a load test: the full suite runs it, the quick tier does not
@pytest.mark.timeout(900)  # 10k ingests: minutes when the machine is busy
def test_report_of_a_10k_step_run_is_under_5_mb(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'long.db'}", sqlite_synchronous="OFF")
    try:
        t0 = time.perf_counter()
        ingest_steps(store, "long", 10_000)
        t1 = time.perf_counter()
        page = build_report(store, "long")
        t2 = time.perf_counter()
    finally:
        store.close()
    size = len(page.encode())
    print(f"10k steps: ingest {t1 - t0:.1f} s, report {t2 - t1:.2f} s, {size:,} bytes")
    assert size < 5 * 2**20
    assert "10000 steps, steps 0–9999" in page
    assert "merged over 256 step(s), 9744–9999" in page
