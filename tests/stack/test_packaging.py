"""The wheel: built from this checkout, installed into a clean virtualenv, it adds exactly one
top-level import name (``timwatch``), its console script runs, and it carries the migrations and
the dashboards the service and ``dashboards push`` read at run time. The wheel is the session's
(tests/stack/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


def test_wheel_has_one_top_level_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        top_level = next(n for n in names if n.endswith("top_level.txt"))
        assert z.read(top_level).decode().split() == ["timwatch"]
    assert top == {"timwatch"}
    for needed in (
        "timwatch/monitor/store/migrations/env.py",
        "timwatch/monitor/store/migrations/versions/0001_initial.py",
        "timwatch/dashboards/timwatch-run.json",
        "timwatch/py.typed",
    ):
        assert needed in names, needed


def test_clean_venv_gains_only_timwatch(
    wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into a fresh venv that borrows this environment's dependencies (a ``.pth`` line adds their
    directory to sys.path; the editable install's own hook there is not run), the wheel adds
    one importable top-level name; ``timwatch --version`` works from its console script."""
    monkeypatch.delenv("PYTHONPATH", raising=False)  # or a checkout on it shadows the wheel
    import site
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    own = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    deps = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    (Path(own) / "borrowed-deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    listing = (
        "import pkgutil, sys; "
        "print('\\n'.join(sorted(m.name for m in pkgutil.iter_modules() "
        "if m.module_finder.path.startswith(sys.prefix))))"
    )

    def top_level() -> set[str]:
        out = subprocess.run([str(py), "-c", listing], capture_output=True, text=True,
                             check=True, cwd=tmp_path)  # fmt: skip
        return set(out.stdout.split())

    before = top_level()
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    assert top_level() - before == {"timwatch"}
    version = subprocess.run(
        [str(venv / "bin" / "timwatch"), "--version"], capture_output=True, text=True,
        cwd=tmp_path,
    )  # fmt: skip
    assert version.stdout.startswith("timwatch "), version.stderr
    probe = subprocess.run(
        [str(py), "-c", "import timwatch.monitor.store.db as d, timwatch.dashboards as b; "
         "print(d.MIGRATIONS_DIR.is_dir(), len(b.dashboard_files()))"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert probe.stdout.split() == ["True", "3"]
