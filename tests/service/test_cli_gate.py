"""``timwatch gate`` and ``timwatch compare`` as CI runs them (the program run in this process,
`tests.helpers.cli.timwatch`) on runs of the demo's real RL loop (`tests.helpers.demo_batches`:
bf16 and fp32 engine copies against the fp32 trainer) read from batch-file directories (no
service) and from a real server; exit 0 pass, 1 fail, 2 error with one line on stderr naming the
problem."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers.cli import clean_env
from tests.helpers.cli import timwatch as run_timwatch
from tests.helpers.demo_batches import write_demo_run
from tests.helpers.procs import REPO, SHARED_READ_TOKEN, ServerProc
from tests.helpers.wire import fresh_run

STEPS = 8
ID = ["--model", "tiny-lm", "--engine", "embedded"]


def timwatch(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return run_timwatch(*args, cwd=cwd, env=clean_env(COLUMNS="240"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("batches")
    write_demo_run(root, "fp32-a", seed=1, steps=STEPS, precision="fp32")
    write_demo_run(root, "fp32-b", seed=2, steps=STEPS, precision="fp32", fmt="json")
    write_demo_run(root, "bf16-a", seed=1, steps=STEPS, precision="bf16")
    return root


@pytest.fixture(scope="module")
def baseline(runs: Path) -> Path:
    path = runs / "fp32.json"
    p = timwatch("gate", "fp32-a", "--batches", str(runs), "--write-baseline", str(path), *ID)
    assert p.returncode == 0, p.stderr
    assert f"wrote baseline {path}" in p.stdout
    return path


def test_fp32_passes_bf16_fails_against_the_fp32_baseline(
    runs: Path, baseline: Path, tmp_path: Path
) -> None:
    p = timwatch("gate", "fp32-b", "--batches", str(runs), "--baseline", str(baseline), *ID)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("PASS run fp32-b against baseline fp32-a (tiny-lm on embedded)")
    junit, md = tmp_path / "gate.xml", tmp_path / "gate.md"
    p = timwatch("gate", "bf16-a", "--batches", str(runs), "--baseline", str(baseline), *ID,
                 "--junit", str(junit), "--markdown", str(md), "--json")  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    res = json.loads(p.stdout)
    assert res["passed"] is False
    kl = next(c for c in res["checks"] if c["metric"] == "mismatch_kl")
    assert kl["passed"] is False and kl["candidate"] > 1e3 * kl["baseline"]
    assert md.read_text().startswith("**timwatch gate: FAIL** — run `bf16-a`")
    assert "<failure" in junit.read_text()


def _truncate(runs: Path, tmp_path: Path, suffix: str) -> Path:
    root = tmp_path / "cut"
    src = runs / ("fp32-a" if suffix == ".safetensors" else "fp32-b")
    (root / "cut").mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        (root / "cut" / f.name).write_bytes(data[: len(data) // 2] if "00003" in f.name else data)
    return root


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope", "--baseline", "{b}", *ID], "unknown run 'nope'"),
        (["fp32-b", "--baseline", "{b}", "--model", "tiny-lm", "--engine", "vllm"],
         "the baseline is for engine 'embedded', the run is engine 'vllm'"),
        (["fp32-b", "--baseline", "{b}", "--model", "other", "--engine", "embedded"],
         "the baseline is for model 'tiny-lm', the run is model 'other'"),
        (["fp32-b", "--baseline", "{b}", *ID, "--from-step", "100"], "no steps in the range"),
        (["fp32-b", "--baseline", "{b}", *ID, "--from-step", "5", "--to-step", "2"],
         "--from-step 5 is after --to-step 2"),
        (["fp32-b", "--write-baseline", "{t}/x.json", *ID, "--metric", "kl"],
         "unknown metric 'kl'"),
        (["fp32-b", "--baseline", "{t}/missing.json", *ID], "No such file"),
        (["fp32-b", "--baseline", "{b}"], "name the run's --model"),
        (["fp32-b", *ID], "give --baseline FILE|RUN or --write-baseline FILE"),
        (["fp32-b", "bf16-a", "--baseline", "{b}", *ID],
         "gate one run at a time: got 2 (fp32-b, bf16-a)"),
        (["fp32-b", "nope", "--write-baseline", "{t}/x.json", *ID], "unknown run 'nope'"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(
    runs: Path, baseline: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    args = [a.format(b=baseline, t=tmp_path) for a in args]
    p = timwatch("gate", *args, "--batches", str(runs))
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("timwatch gate: "), p.stderr
    assert message in lines[0]


@pytest.mark.parametrize("suffix", [".safetensors", ".json"])
def test_a_truncated_batch_file_is_named(
    runs: Path, baseline: Path, tmp_path: Path, suffix: str
) -> None:
    root = _truncate(runs, tmp_path, suffix)
    p = timwatch("gate", "cut", "--batches", str(root), "--baseline", str(baseline), *ID)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"step-00003{suffix}" in lines[0], p.stderr


def test_compare_from_files_and_from_a_server_agree(
    runs: Path, shared_server: ServerProc, tmp_path: Path
) -> None:
    """The same batches read from files and posted to a server give the same comparison; the
    CLI's --url answer is the API's; the report page renders it."""
    names = {"fp32-a": fresh_run("gate-fp32"), "bf16-a": fresh_run("gate-bf16")}
    with shared_server.client() as c:
        for run, remote in names.items():
            for f in sorted((runs / run).iterdir()):
                r = c.post(f"/v1/runs/{remote}/batches", content=f.read_bytes(),
                           headers={"Content-Type": "application/x-safetensors"})  # fmt: skip
                assert r.is_success, r.text
        api = c.get("/v1/compare", params={"a": names["fp32-a"], "b": names["bf16-a"]}).json()
        page = c.get(f"/v1/runs/{names['bf16-a']}/report.html",
                     params={"against": names["fp32-a"]}).text  # fmt: skip
        missing = c.get("/v1/compare", params={"a": "nope", "b": names["bf16-a"]})
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]
    server = ["--url", shared_server.url, "--token", SHARED_READ_TOKEN]
    p = timwatch("compare", names["fp32-a"], names["bf16-a"], *server, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == api
    p = timwatch("compare", "fp32-a", "bf16-a", "--batches", str(runs), "--json")
    assert p.returncode == 0, p.stderr
    files = json.loads(p.stdout)
    assert [m["ratio"] for m in files["metrics"]] == [m["ratio"] for m in api["metrics"]]
    assert [(m["lo"], m["hi"]) for m in files["metrics"]] == [
        (m["lo"], m["hi"]) for m in api["metrics"]
    ]
    kl = files["metrics"][0]
    assert kl["metric"] == "mismatch_kl" and kl["lo"] > 1e3  # bf16 ≫ fp32
    assert files["verdict"].startswith("bf16-a's mismatch_kl is ")
    assert "worse" in files["verdict"] and "precision:" in files["verdict"]
    assert f'<h2 id="compare">Compared with <code>{names["fp32-a"]}</code></h2>' in page
    assert "<th>metric</th>" in page and "<strong>" in page


def test_compare_api_bad_input_names_it(shared_server: ServerProc) -> None:
    from tests.helpers.diagnosis_batches import labelled_batch

    run = fresh_run("cmp-api")
    with shared_server.client() as c:
        for step in range(3):
            assert c.post(f"/v1/runs/{run}/batches", json=labelled_batch("stale", step)).is_success
        ok = c.get("/v1/compare", params={"a": run, "b": run})
        assert ok.status_code == 200, ok.text
        body = ok.json()
        assert body["rough"] is True and body["verdict"].endswith("no clear difference")
        assert body["markdown"].startswith(f"**{run}'s mismatch_kl is 1")
        cases: list[tuple[dict[str, str | int], int, str]] = [
            ({"a": run, "b": "nope-x"}, 404, "nope-x"),
            ({"a": run, "b": run, "from_step": 3, "to_step": 1}, 422, "after to_step"),
            ({"a": run, "b": run, "from_step": 100}, 422, "no steps"),
            ({"a": run, "b": run, "seed": -1}, 422, "seed"),
            ({"a": run}, 422, "b"),
        ]
        for params, status, word in cases:
            r = c.get("/v1/compare", params=params)
            assert r.status_code == status, (params, r.text)
            assert word in r.text, (params, r.text)
    with httpx.Client(base_url=shared_server.url) as anon:
        assert anon.get("/v1/compare", params={"a": run, "b": run}).status_code == 401
