"""Every mistake a new user makes on the command line ends in ONE line on stderr that says what
to do, exit code 2, and no traceback, in a scratch directory, a real server where one is needed.

The program runs in this process (`tests.helpers.cli.timwatch`), except ``timwatch serve`` and
the hostile files, which run as real ``python -m timwatch`` subprocesses (input that could crash
an interpreter must not take the test's with it); `test_a_process_prints_what_main_prints`
checks that both ways answer the same, byte for byte."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import typer

from tests.helpers.cli import timwatch as in_process
from tests.helpers.cli import timwatch_process as as_process
from tests.helpers.procs import REPO, ServerProc, free_port
from timwatch.monitor.cli.program import DEBUG_ENV, run

EXAMPLE = REPO / "examples" / "batch.json"
CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in ("TIMWATCH_URL", "TIMWATCH_TOKEN", "TIMWATCH_READ_TOKEN", "TIMWATCH_DB", DEBUG_ENV)
}


def timwatch(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return in_process(*args, cwd=cwd, env={**CLEAN_ENV, **(env or {})}, timeout=120)


def timwatch_process(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return as_process(*args, cwd=cwd, env={**CLEAN_ENV, **(env or {})}, timeout=120)


def one_error_line(p: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The single stderr line of a refused command, checked to contain every fragment."""
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr + p.stdout
    assert len(lines) == 1, p.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------ serve --db


def test_db_in_a_missing_directory_is_refused_and_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    p = timwatch("serve", "--db", f"sqlite:///{missing}/x.db", cwd=tmp_path)
    one_error_line(p, f"directory {missing} does not exist", "create it")
    assert not missing.exists()
    assert "listening" not in p.stdout


def without_root_override() -> list[str]:
    """A command prefix under which root obeys permission bits (CAP_DAC_OVERRIDE dropped), so
    a read-only directory is read-only to the test as it is to an ordinary user."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set=-dac_override"]
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"]).returncode != 0:
        pytest.skip("running as root without a way to drop CAP_DAC_OVERRIDE (setpriv)")
    return prefix


def test_db_in_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    p = subprocess.run(
        [
            *without_root_override(),
            sys.executable,
            "-m",
            "timwatch",
            "serve",
            "--db",
            f"sqlite:///{ro}/x.db",
        ],
        cwd=tmp_path,
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_error_line(p, f"directory {ro} is not writable")
    assert list(ro.iterdir()) == []


def test_db_path_without_scheme_gets_the_url_to_write(tmp_path: Path) -> None:
    p = timwatch("serve", "--db", "timwatch.db", cwd=tmp_path)
    one_error_line(p, "use sqlite:///timwatch.db")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(
    importlib.util.find_spec("psycopg2") is not None, reason="psycopg2 is installed here"
)
def test_missing_postgres_driver_names_the_url_and_the_extra(tmp_path: Path) -> None:
    p = timwatch("serve", "--db", "postgresql+psycopg2://u@127.0.0.1:1/x", cwd=tmp_path)
    one_error_line(p, "postgresql+psycopg://u@127.0.0.1:1/x", "pip install 'timwatch[postgres]'")


@pytest.mark.parametrize("scheme", ["postgresql+psycopg", "postgresql"])
def test_unreachable_postgres_is_one_line(tmp_path: Path, scheme: str) -> None:
    url = f"{scheme}://u:secret@127.0.0.1:{free_port()}/x"
    p = timwatch("serve", "--db", url, cwd=tmp_path)
    line = one_error_line(p)
    assert "secret" not in line  # the password is never printed
    if scheme == "postgresql+psycopg" or "cannot connect" in line:
        assert f"cannot connect to {scheme}://u:***@127.0.0.1" in line
    else:  # an SQLAlchemy whose postgresql:// default driver is psycopg2
        assert "postgresql+psycopg://" in line


# -------------------------------------------------------------------------- serve --port


def test_busy_port_is_refused_before_the_startup_line(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p = timwatch(
            "serve", "--port", str(port), "--db", f"sqlite:///{tmp_path}/x.db", cwd=tmp_path
        )
    line = one_error_line(p, f"port {port} is in use: try --port ")
    hint = int(line.rsplit("--port ", 1)[1])
    assert port < hint <= port + 20
    assert "listening" not in p.stdout
    assert not (tmp_path / "x.db").exists()  # refused before the store was opened


@pytest.mark.parametrize("port", ["99999", "-1", "0"])
def test_port_out_of_range(tmp_path: Path, port: str) -> None:
    p = timwatch("serve", "--port", port, "--db", f"sqlite:///{tmp_path}/x.db", cwd=tmp_path)
    one_error_line(p, "port must be 1–65535", port)


# ------------------------------------------------------------------ history without a server


@pytest.mark.parametrize(
    "args",
    [["runs"], ["query", "r", "-m", "mismatch_kl"], ["show", "r", "3"], ["report", "r"]],
)
def test_history_commands_without_a_server(tmp_path: Path, args: list[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    p = timwatch(*args, "--url", url, cwd=tmp_path)
    one_error_line(
        p, f"cannot reach timwatch at {url}", "`timwatch serve`", "--url", "TIMWATCH_URL"
    )
    by_env = timwatch(*args, cwd=tmp_path, env={"TIMWATCH_URL": url})
    one_error_line(by_env, f"cannot reach timwatch at {url}")


def test_history_commands_name_an_unknown_run(tmp_path: Path, server: ServerProc) -> None:
    for args in (["report", "nope"], ["query", "nope", "-m", "mismatch_kl"]):
        one_error_line(timwatch(*args, "--url", server.url, cwd=tmp_path), "run 'nope' not found")
    one_error_line(
        timwatch("show", "nope", "1", "--url", server.url, cwd=tmp_path), "run 'nope' not found"
    )
    with httpx.Client(base_url=server.url) as c:
        r = c.post(
            "/v1/runs/known/batches",
            content=EXAMPLE.read_bytes(),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 200, r.text
    one_error_line(
        timwatch("query", "known", "-m", "no_such_metric", "--url", server.url, cwd=tmp_path),
        "no_such_metric",
    )


def test_url_without_scheme(tmp_path: Path) -> None:
    p = timwatch("runs", "--url", "localhost:8000", cwd=tmp_path)
    one_error_line(p, "needs http:// or https://")


# ------------------------------------------------------------------------------- analyze


def test_analyze_missing_file(tmp_path: Path) -> None:
    one_error_line(timwatch("analyze", "missing.json", cwd=tmp_path), "missing.json: no such file")


def test_analyze_file_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "notes.json").write_text("step: 3\n")
    one_error_line(timwatch("analyze", "notes.json", cwd=tmp_path), "not valid JSON")


def test_analyze_invalid_batch_names_field_and_index(tmp_path: Path) -> None:
    obj = json.loads(EXAMPLE.read_text())
    obj["loss_mask"][5] = 7
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    p = timwatch("analyze", "bad.json", cwd=tmp_path)
    one_error_line(p, "loss_mask[5]", "not 0 or 1")
    assert p.stdout == ""


# ---------------------------------------------------------------------- options and usage


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["analyze", str(EXAMPLE), "--tau", "-1"], ["--tau must be a positive number"]),
        (["analyze", str(EXAMPLE), "--kpop-phi", "0"], ["--kpop-phi must be a positive number"]),
        (["analyze", str(EXAMPLE), "--icepop-low", "6"], ["--icepop-low", "--icepop-high"]),
        (["analyze", str(EXAMPLE), "--nonfinite", "keep"], ["--nonfinite", "'refuse' or 'drop'"]),
        (["serve", "--tau", "nan"], ["--tau must be a positive number"]),
        (["serve", "--geo-rs-low", "2"], ["--geo-rs-low", "--geo-rs-high"]),
        (["serve", "--port", "abc"], ["--port", "timwatch serve --help"]),
        (["query", "r"], ["--metric", "timwatch query --help"]),
        (["show", "r"], ["STEP"]),
        (["no-such-command"], ["no-such-command"]),
    ],
)
def test_bad_options_are_one_line(tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    one_error_line(timwatch(*args, cwd=tmp_path), *fragments)
    assert list(tmp_path.iterdir()) == []  # serve refused before creating ./timwatch.db


def test_a_bug_is_one_line_too_and_debug_shows_the_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = typer.Typer()

    @app.command()
    def boom() -> None:
        raise KeyError("oops")

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert run(app, [], prog_name="tool") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected KeyError" in err and DEBUG_ENV in err
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(KeyError):
        run(app, [], prog_name="tool")


@pytest.mark.parametrize(
    "args",
    [
        ["analyze", "missing.json"],
        ["analyze", str(EXAMPLE), "--tau", "-1"],
        ["runs", "--url", "localhost:8000"],
        ["query", "r"],
        ["no-such-command"],
        ["analyze", str(EXAMPLE)],
        ["analyze", str(EXAMPLE), "--json"],
        ["gate", "--help"],
    ],
    ids=lambda a: " ".join(a).replace(str(EXAMPLE), "EXAMPLE"),
)
def test_a_process_prints_what_main_prints(tmp_path: Path, args: list[str]) -> None:
    """The in-process runner stands for ``python -m timwatch``: same exit code, stdout, stderr."""
    env = {"COLUMNS": "120"}
    process = timwatch_process(*args, cwd=tmp_path, env=env)
    here = timwatch(*args, cwd=tmp_path, env=env)
    assert (here.returncode, here.stdout, here.stderr) == (
        process.returncode,
        process.stdout,
        process.stderr,
    )
    assert process.stdout or process.stderr


# ------------------------------------------------------------------ analyze: hostile files


def _f16_example() -> bytes:
    """examples/batch.safetensors with every float tensor stored as float16."""
    from timwatch.monitor.core.batch import Batch

    batch = Batch.from_json_bytes(EXAMPLE.read_bytes())
    from safetensors.numpy import save

    arrays = {
        k: (v.astype(np.float16) if v.dtype.kind == "f" else v) for k, v in batch.arrays().items()
    }
    return save(arrays, metadata={"step": str(batch.step)})


def _edited(field: str, value: Any) -> bytes:
    """examples/batch.json with `field` at its first kept token set to `value`."""
    obj = json.loads(EXAMPLE.read_text())
    obj[field][obj["loss_mask"].index(1)] = value
    return json.dumps(obj).encode()


HOSTILE_FILES = [
    (
        "truncated.safetensors",
        (REPO / "examples" / "batch.safetensors").read_bytes()[:-9],
        ["truncated.safetensors", "invalid safetensors"],
    ),
    (
        "garbage.safetensors",
        b"\x07\x00\x00\x00\x00\x00\x00\x00\xff\xfe\x00garbage",
        ["garbage.safetensors", "invalid safetensors"],
    ),
    ("garbage.json", b"\x00\xff\x13garbage", ["garbage.json", "not valid JSON"]),
    ("bad.json", b'{"step": 3,', ["bad.json", "not valid JSON"]),
    ("nested.json", b"[" * 100_000 + b"]" * 100_000, ["nested.json", "JSON object"]),
    ("nested_field.json", b'{"logp_rollout": ' + b"[" * 100_000, ["logp_rollout"]),
    (
        "huge_step.json",
        EXAMPLE.read_bytes().replace(b'"step": 3', b'"step": 18446744073709551616'),
        ["huge_step.json", "step must be"],
    ),
    (
        "huge_version.json",
        _edited("versions", 2**63),
        ["huge_version.json", "versions[0]", "int64"],
    ),
    (
        "floor.json",
        _edited("logp_rollout", -1e308),
        ["floor.json", "logp_rollout"],
    ),
]


@pytest.mark.parametrize(
    ("name", "data", "fragments"), HOSTILE_FILES, ids=[h[0] for h in HOSTILE_FILES]
)
def test_analyze_hostile_file_is_one_line(
    tmp_path: Path, name: str, data: bytes, fragments: list[str]
) -> None:
    (tmp_path / name).write_bytes(data)
    p = timwatch_process("analyze", name, cwd=tmp_path)
    one_error_line(p, *fragments)
    assert p.stdout == ""


def test_analyze_a_directory_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "batch.json").mkdir()
    one_error_line(timwatch("analyze", "batch.json", cwd=tmp_path), "batch.json is a directory")


def test_analyze_accepts_float16_safetensors(tmp_path: Path) -> None:
    (tmp_path / "f16.safetensors").write_bytes(_f16_example())
    p = timwatch("analyze", "f16.safetensors", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tokens"] > 0


@pytest.mark.parametrize(
    "data",
    [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe\x00garbage", b'{"uid": "a",'],
    ids=["nested", "binary", "truncated"],
)
def test_hostile_dashboard_file_is_a_value_error(tmp_path: Path, data: bytes) -> None:
    from timwatch.monitor.cli.dashboards import load_dashboard

    (tmp_path / "d.json").write_bytes(data)
    with pytest.raises(ValueError, match=r"d\.json: not valid JSON"):
        load_dashboard(tmp_path / "d.json")
