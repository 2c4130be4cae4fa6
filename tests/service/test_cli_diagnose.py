"""``timwatch diagnose`` as a user runs it (the program in this process) against a real server;
the table and ``--json`` show the API's diagnosis; bad input is one line on stderr and exit
code 2."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.cli import clean_env
from tests.helpers.cli import timwatch as run_timwatch
from tests.helpers.diagnosis_batches import labelled_batch
from tests.helpers.procs import SHARED_READ_TOKEN, ServerProc
from tests.helpers.wire import fresh_run


def timwatch(*args: str) -> subprocess.CompletedProcess[str]:
    return run_timwatch(*args, env=clean_env(COLUMNS="240"))


@pytest.fixture
def stale_run(shared_server: ServerProc) -> str:
    run = fresh_run("cli-diag")
    with shared_server.client() as c:
        for step in range(6):
            assert c.post(f"/v1/runs/{run}/batches", json=labelled_batch("stale", step)).is_success
    return run


def test_json_is_the_api_answer(shared_server: ServerProc, stale_run: str) -> None:
    p = timwatch("diagnose", stale_run, "--url", shared_server.url, "--token", SHARED_READ_TOKEN,
                 "--json", "--from-step", "1")  # fmt: skip
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    with shared_server.client() as c:
        want = c.get(f"/v1/runs/{stale_run}/diagnosis", params={"from_step": 1}).json()
    assert got == want and got["from_step"] == 1 and got["causes"][0]["cause"] == "staleness"


def test_table_names_the_causes_and_the_evidence(shared_server: ServerProc, stale_run: str) -> None:
    p = timwatch("diagnose", stale_run, "--url", shared_server.url, "--token", SHARED_READ_TOKEN)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert f"run {stale_run} · 6 steps · steps 0–5" in out
    for word in ("staleness", "precision", "staleness_kl", "not checked", "teacher_collapse"):
        assert word in out, word
    assert out.index("staleness") < out.index("precision")  # ranked: staleness first


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from-step", "5", "--to-step", "2"], "--from-step 5 is after --to-step 2"),
        (["--from-step", "-1"], "--from-step"),
        ([], "not found"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    shared_server: ServerProc, args: list[str], message: str
) -> None:
    p = timwatch("diagnose", "no-such-run-cli", "--url", shared_server.url, "--token",
                 SHARED_READ_TOKEN, *args)  # fmt: skip
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert lines[0].startswith("timwatch diagnose:")
