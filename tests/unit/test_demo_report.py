"""The demo's hints name a program and a history the user can paste from any directory."""

from __future__ import annotations

import io
import shlex
from pathlib import Path

import pytest
from rich.console import Console

from timwatch.sidecar.demo.report import history_url, live_hints, offline_hints, program


def script(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_program_under_python_dash_m_is_the_interpreter() -> None:
    assert program("/x/timwatch/__main__.py", "/v/bin/python") == "/v/bin/python -m timwatch"
    assert program("", "/v w/python") == "'/v w/python' -m timwatch"


def test_program_found_on_path_is_its_bare_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = script(tmp_path / "bin" / "timwatch")
    monkeypatch.setenv("PATH", str(exe.parent))
    assert program(str(exe), "/v/bin/python") == "timwatch"


def test_program_not_on_path_is_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = script(tmp_path / "my venv" / "bin" / "timwatch")
    other = script(tmp_path / "elsewhere" / "timwatch")  # a different timwatch on PATH
    monkeypatch.setenv("PATH", str(other.parent))
    monkeypatch.chdir(tmp_path)
    got = program("my venv/bin/timwatch", "/v/bin/python")
    assert got == shlex.quote(str(exe)) and shlex.split(got) == [str(exe)]


def test_history_url_is_absolute_for_sqlite_and_hides_passwords(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert history_url("sqlite:///./timwatch-demo.db") == f"sqlite:///{tmp_path}/timwatch-demo.db"
    assert history_url("sqlite:////abs/h.db") == "sqlite:////abs/h.db"
    pg = history_url("postgresql+psycopg://tw:secret@db:5432/timwatch")
    assert "secret" not in pg and pg.endswith("@db:5432/timwatch")


def test_hints_are_one_line_each_even_when_narrow() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=40)
    offline_hints(console, run="my run", db="sqlite:////a/very/long/path/to/the/demo.db", prog="tw")
    live_hints(console, run="my run", url="http://127.0.0.1:5", worst=2, prog="tw")
    lines = buf.getvalue().splitlines()
    assert "  serve        tw serve --db sqlite:////a/very/long/path/to/the/demo.db" in lines
    assert "  query        tw query 'my run' -m mismatch_kl -m staleness_kl" in lines
    assert "  step API     curl -s 'http://127.0.0.1:5/v1/runs/my%20run/steps/2'" in lines
    assert "  step CLI     tw show 'my run' 2 --url http://127.0.0.1:5" in lines
