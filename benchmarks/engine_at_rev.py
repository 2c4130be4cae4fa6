"""The engine of an older git revision, timed on the metric benchmark's batch, in a subprocess.

`measure(rev)` exports `rev` with `git archive` into `<tmp>/timwatch-bench-<rev>` (kept, so its
numba cache survives between runs), then runs this file there with the exported tree first on
`PYTHONPATH`: `import timwatch` loads the old engine, `metrics_batch` (beside this file) builds
the same batch, and the timing is the same as `metrics_throughput.py`'s (one thread, minimum of
N rounds of `derive_row(accumulate(batch, threads=1))`, thread CPU time unless `--wall`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _tree(rev: str) -> Path:
    full = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    tree = Path(tempfile.gettempdir()) / f"timwatch-bench-{full[:12]}"
    if not (tree / "timwatch").exists():
        with tempfile.TemporaryDirectory(dir=tree.parent) as tmp:
            archive = Path(tmp) / "rev.tar"
            subprocess.run(
                ["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), full],
                check=True,
            )
            staged = Path(tmp) / "tree"
            with tarfile.open(archive) as tar:
                tar.extractall(staged, filter="tar")
            staged.rename(tree)
    return tree


def measure(rev: str, tokens: int, sequences: int, repeat: int, wall: bool) -> dict[str, Any]:
    """{"seconds": best time of the old engine, "masked": masked tokens, "rev": rev}."""
    tree = _tree(rev)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--emit", "--tokens", str(tokens)]
    cmd += ["--sequences", str(sequences), "--repeat", str(repeat)] + (["--wall"] if wall else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the engine at {rev} failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout)
    out["rev"] = rev
    return out


def _emit(args: argparse.Namespace) -> None:
    from metrics_batch import make_batch

    import timwatch
    from timwatch.monitor.core.engine import accumulate
    from timwatch.monitor.core.masks import PolicyParams
    from timwatch.monitor.core.row import derive_row

    assert not str(Path(timwatch.__file__).resolve()).startswith(str(ROOT)), timwatch.__file__
    clock = time.perf_counter if args.wall else time.thread_time
    b = make_batch(args.tokens, args.sequences)
    params = PolicyParams()
    derive_row(accumulate(b, params, threads=1))
    times = []
    for _ in range(args.repeat):
        t = clock()
        derive_row(accumulate(b, params, threads=1))
        times.append(clock() - t)
    json.dump({"seconds": min(times), "masked": int(b.loss_mask.sum())}, sys.stdout)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--emit", action="store_true")
    ap.add_argument("--rev", default="e8c9d4d")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--sequences", type=int, default=2_000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--wall", action="store_true")
    a = ap.parse_args()
    if a.emit:
        _emit(a)
    else:
        print(json.dumps(measure(a.rev, a.tokens, a.sequences, a.repeat, a.wall)))
