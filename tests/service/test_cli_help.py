"""What ``--help`` and ``timwatch show`` print: plain types and defaults, options generated from
`PolicyParams`, policy names and buckets on screen."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import httpx
import pytest
import typer.main
from typer._click.core import Command, Context
from typer.core import TyperGroup

from tests.helpers.procs import REPO, ServerProc
from timwatch.cli import app
from timwatch.commands import program
from timwatch.monitor.cli.program import run
from timwatch.monitor.core.masks import POLICIES, PolicyParams

EXAMPLE = REPO / "examples" / "batch.json"
#: typer's own type labels, brace-wrapped argument names and empty defaults
NOISE = re.compile(r"<(bool|str|int|float|path|list\[)|\{[a-z_]+\}|\[default: None\]")


def command_paths() -> list[list[str]]:
    """Every command and group of the program, as argument lists (``[]`` is the root)."""
    out: list[list[str]] = []

    def walk(cmd: Command, path: list[str]) -> None:
        out.append(path)
        if isinstance(cmd, TyperGroup):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return out


def command_at(path: list[str]) -> Command:
    cmd = typer.main.get_command(app)
    for name in path:
        assert isinstance(cmd, TyperGroup)
        cmd = cmd.commands[name]
    return cmd


def help_text(path: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert run(app, [*path, "--help"]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    return out.out


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")


def test_every_command_is_listed() -> None:
    names = {" ".join(p) for p in command_paths()}
    assert {"", "serve", "analyze", "runs", "query", "show", "report", "demo"} <= names
    assert {"dashboards push", "sidecar sglang", "sidecar vllm"} <= names


@pytest.mark.parametrize("path", command_paths(), ids=lambda p: " ".join(p) or "timwatch")
def test_help_has_no_type_noise_and_shows_defaults(
    path: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    text = help_text(path, capsys)
    assert f"Usage: {' '.join(['timwatch', *path])} " in text
    assert NOISE.search(text) is None, NOISE.search(text)
    cmd = command_at(path)
    params = cmd.get_params(Context(cmd))
    assert all(getattr(p, "help", None) for p in params), "a parameter lacks help"
    shown = [
        p
        for p in params
        if p.default not in (None, False) and getattr(p, "show_default", True) is not False
    ]
    assert text.count("[default:") >= len(shown)


def test_root_help_as_a_user_runs_it() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "timwatch", "--help"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "120"},
    )  # fmt: skip
    assert p.returncode == 0 and p.stderr == ""
    assert NOISE.search(p.stdout) is None and "--version" in p.stdout


@pytest.mark.parametrize("path", [p for p in command_paths() if p], ids=lambda p: " ".join(p))
def test_a_command_mounted_alone_helps_as_in_the_whole_program(
    path: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    whole = help_text(path, capsys)
    assert run(program(path[0]), [*path, "--help"]) == 0
    assert capsys.readouterr().out == whole


def test_a_command_runs_without_importing_the_others() -> None:
    probe = (
        "import atexit, sys\n"
        "names = ('timwatch.monitor.cli.serve', 'timwatch.monitor.cli.compare', "
        "'timwatch.sidecar.cli', 'numba')\n"
        "atexit.register(lambda: print([n for n in names if n in sys.modules]))\n"
        "from timwatch.cli import main\n"
        "main(['runs', '--url', 'http://127.0.0.1:1'])\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert p.returncode == 2 and "cannot reach" in p.stderr.lower(), p.stderr
    assert p.stdout.strip() == "[]", p.stdout


@pytest.mark.parametrize("command", ["analyze", "serve"])
def test_policy_options_are_the_policy_params_fields(command: str) -> None:
    cmd = command_at([command])
    options = {p.name: p for p in cmd.params}
    for f in fields(PolicyParams):
        opt = options[f.name]
        assert f"--{f.name.replace('_', '-')}" in opt.opts
        assert f.default is not MISSING and opt.default == f.default
        assert getattr(opt, "help", None) == f.metadata["help"]


def test_show_prints_policy_names_and_buckets(server: ServerProc, tmp_path: Path) -> None:
    with httpx.Client(base_url=server.url) as c:
        r = c.post("/v1/runs/shown/batches", content=EXAMPLE.read_bytes(),
                   headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 200, r.text
        row = r.json()["row"]
    p = subprocess.run(
        [sys.executable, "-m", "timwatch", "show", "shown", str(row["step"]), "--url", server.url],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for policy in POLICIES:
        assert re.search(rf"│ {policy}\s+│", out), policy
    for header in ("Length buckets", "Lag buckets", "Heatmap", "Worst tokens"):
        assert header in out
    assert row["lag_buckets"]  # the example carries versions: one table row per lag
    for lag in row["lag_buckets"]:
        assert re.search(rf"│\s+{lag} │\s+{row['lag_buckets'][lag]['tokens']} │", out)
    for b, bucket in row["length_buckets"].items():
        assert f"{2 ** int(b)}–{2 ** (int(b) + 1) - 1}" in out and str(bucket["sequences"]) in out
    heat = row["heatmap"]
    for label, counts, rejected in zip(
        ["[0, 0.01)", "≥ 3"], heat["all"][::6], heat["estr_rejected"][::6], strict=True
    ):
        cells = [f"{n} \\({r}\\)" if r else str(n) for n, r in zip(counts, rejected, strict=True)]
        assert re.search(re.escape(f"│ {label}") + r"\s+│\s+" + r"\s+│\s+".join(cells) + " │", out)
