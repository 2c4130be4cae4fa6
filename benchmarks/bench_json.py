"""The results file every benchmark writes with ``--json PATH``.

One JSON object per run: which benchmark, the exact command (``--json`` left out), when, on what
machine and commit, the figures, the ratios against the baselines measured in the same run, and
the table rows. docs/performance.md is rendered from the committed files in
``benchmarks/results/`` (``docs/generate_performance.py``), so a figure in the docs is always one
of these. Values are numbers or short strings; rows are lists of flat objects whose keys are the
table's column headings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def add_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--json",
        metavar="PATH",
        type=Path,
        default=None,
        help="also write the results as JSON to PATH (docs/performance.md renders "
        "benchmarks/results/<name>.json)",
    )


def _command() -> str:
    argv, out, skip = sys.argv[1:], [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--json":
            skip = True
            continue
        if a.startswith("--json="):
            continue
        out.append(a)
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return " ".join(["python", shlex.quote(str(script)), *map(shlex.quote, out)])


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
            text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+changes" if dirty else "")


def machine() -> dict[str, Any]:
    return {
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "commit": _commit(),
    }


def write(
    path: Path | None,
    name: str,
    figures: dict[str, Any],
    ratios: dict[str, Any] | None = None,
    rows: list[dict[str, Any]] | None = None,
    note: str = "",
) -> None:
    """Write the run's results to `path` (nothing when it is None)."""
    if path is None:
        return
    record = {
        "benchmark": name,
        "command": _command(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "figures": figures,
        "ratios": ratios or {},
        "rows": rows or [],
        "note": note,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}")
