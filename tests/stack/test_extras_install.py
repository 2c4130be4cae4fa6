"""The wheel and its extras installed from the package index into fresh virtualenvs
(``python -m venv``; pip from this machine's configuration, so it needs the index).

- ``pip install timwatch`` adds at most three distributions counting timwatch (today numpy and
  timwatch), changes none that was there, and the trainer's paths run there
  (tests/helpers/trainer_paths.py); every command names the extra it lacks.
- Over a real urllib3, each extra installed in turn leaves ``import urllib3`` that urllib3 (its
  version, and the files on disk are the urllib3 distribution's), but ``[dashboards]``, whose
  grafana-client brings urllib3-future, which writes its own files over the module; ``pip check``
  stays clean throughout.
- Beside a trainer's pins (verl 0.9.1; trl 1.16.0): pip's resolver, not an install (installing
  either tree takes gigabytes: ray, wandb, tensorboard, pyarrow, datasets). ``pip install
  --dry-run --ignore-installed --report`` of ``timwatch[torch]`` with the trainer and
  ``torch==2.13.0`` (the extra's own pin, so pip never fetches another torch) must find one set of
  versions that satisfies every requirement of both and of their whole dependency trees (the set
  an install would leave and ``pip check`` would pass), holding the urllib3 distribution and not
  urllib3-future.

About two minutes on this 2-core host, idle, on a warm pip cache (55 s the seven extras in
turn, installed without byte-compiling; 42 s and 19 s the two resolutions; 9 s the plain
install).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAINER_PATHS = ROOT / "tests" / "helpers" / "trainer_paths.py"
REAL_URLLIB3 = "2.2.3"  # an older release than the index's newest, so an upgrade would show
#: the extras in the order they are added to one virtualenv; dashboards last: it swaps urllib3
EXTRAS_IN_TURN = ("proxy", "server", "report", "postgres", "torch", "demo", "dashboards")
#: whose files ``import urllib3`` loads, and their version
OWNER = """
import base64, hashlib, importlib.metadata as md, json, pathlib, urllib3
init = pathlib.Path(urllib3.__file__).resolve()
digest = base64.urlsafe_b64encode(hashlib.sha256(init.read_bytes()).digest()).rstrip(b"=")
owners = sorted(
    d.metadata["Name"] for d in md.distributions() for f in d.files or ()
    if f.hash is not None and f.hash.value == digest.decode()
    and pathlib.Path(d.locate_file(f)).resolve() == init
)
print(json.dumps([urllib3.__version__, owners]))
"""


class Venv:
    """A fresh virtualenv under ``path``; commands run there with a clean PYTHONPATH and cwd."""

    def __init__(self, path: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
        self.path, self.bin = path, path / "bin"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(self, *args: str, check: bool = True, timeout: float = 900) -> Any:
        proc = subprocess.run(
            args, capture_output=True, text=True, env=self.env, cwd=self.path, timeout=timeout
        )
        if check:
            assert proc.returncode == 0, f"{args}: {proc.stderr[-3000:]}"
        return proc

    def pip(self, *args: str) -> str:
        out: str = self.run(str(self.bin / "python"), "-m", "pip", *args).stdout
        return out

    def install(self, *args: str) -> str:
        """``pip install``, without byte-compiling what it installs (torch alone is thousands of
        modules; nothing here reads the ``.pyc`` files, and an import writes what it needs)."""
        return self.pip("install", "-q", "--no-compile", *args)

    def installed(self) -> dict[str, str]:
        got = json.loads(self.pip("list", "--format=json"))
        return {d["name"].lower(): d["version"] for d in got}

    def python(self, code: str) -> Any:
        return json.loads(self.run(str(self.bin / "python"), "-c", code).stdout)

    def timwatch(self, *args: str) -> subprocess.CompletedProcess[str]:
        proc: subprocess.CompletedProcess[str] = self.run(
            str(self.bin / "timwatch"), *args, check=False, timeout=120
        )
        return proc


def _hint(what: str, extra: str) -> str:
    return f"{what} needs the [{extra}] extra: pip install 'timwatch[{extra}]'"


def test_plain_install_is_numpy_and_timwatch(wheel: Path, tmp_path: Path) -> None:
    venv = Venv(tmp_path / "venv")
    before = venv.installed()
    venv.install(str(wheel))
    after = venv.installed()
    added = set(after) - set(before)
    assert "timwatch" in added and len(added) <= 3, sorted(added)
    assert added == {"timwatch", "numpy"}
    assert {k: after[k] for k in before} == before
    got = json.loads(venv.run(str(venv.bin / "python"), str(TRAINER_PATHS)).stdout)
    assert got["foreign"] == [] and len(got["posts"]) == 2, got
    assert venv.python("from timwatch.sidecar.tap import Tap; print(1)") == 1
    assert venv.timwatch("--version").stdout.startswith("timwatch ")
    for argv, extra in (
        (["serve"], "server"),
        (["query", "run"], "server"),
        (["sidecar", "sglang", "--upstream", "http://127.0.0.1:9"], "proxy"),
        (["dashboards", "push"], "dashboards"),
        (["demo"], "demo"),
    ):
        proc = venv.timwatch(*argv)
        assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
        assert proc.stderr.splitlines() == [_hint(f"timwatch {argv[0]}", extra)]


def test_each_extra_leaves_urllib3_alone_but_dashboards(wheel: Path, tmp_path: Path) -> None:
    venv = Venv(tmp_path / "venv")
    venv.install(f"urllib3=={REAL_URLLIB3}", str(wheel))
    assert venv.python(OWNER) == [REAL_URLLIB3, ["urllib3"]]
    seen: dict[str, list[Any]] = {}
    for extra in EXTRAS_IN_TURN:
        venv.install(f"{wheel}[{extra}]")
        seen[extra] = venv.python(OWNER)
        assert venv.pip("check").strip() == "No broken requirements found.", extra
        if extra == "proxy":
            assert venv.timwatch("sidecar", "vllm", "--help").returncode == 0
            serve = venv.timwatch("serve", "--help")
            assert serve.stderr.splitlines() == [_hint("timwatch serve", "server")]
        if extra == "server":
            assert venv.timwatch("serve", "--help").returncode == 0
    kept = {e: seen[e] for e in EXTRAS_IN_TURN if e != "dashboards"}
    assert kept == dict.fromkeys(kept, [REAL_URLLIB3, ["urllib3"]])
    version, owners = seen["dashboards"]
    assert owners == ["urllib3-future"] and version != REAL_URLLIB3
    assert venv.timwatch("dashboards", "push", "--help").returncode == 0


@pytest.mark.parametrize("trainer", ["verl==0.9.1", "trl==1.16.0"])
def test_resolves_beside_a_trainers_pins(wheel: Path, tmp_path: Path, trainer: str) -> None:
    venv = Venv(tmp_path / "venv")
    report = tmp_path / "report.json"
    venv.pip(
        "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
        f"{wheel}[torch]", trainer, "torch==2.13.0",
    )  # fmt: skip
    chosen = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    name, _, version = trainer.partition("==")
    assert chosen[name] == version and chosen["torch"].startswith("2.13.0")
    assert "timwatch" in chosen and "numpy" in chosen
    assert "urllib3-future" not in chosen
