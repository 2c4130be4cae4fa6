"""Time to build a run's incident report page, drawn and with its figures reused.

A ``--steps``-step run (`tests.helpers.report_runs`: one 8-token sequence per step, KL rising
over the last fifth) is written to a throw-away SQLite store; `build_report` is then timed
``--repeat`` times with the figure cache emptied before each call (every figure drawn) and
``--repeat`` times with it kept (the page asked again while no step arrived: figures reused),
and the ratio printed.

    python benchmarks/report_cost.py [--steps 300] [--repeat 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_json  # noqa: E402

from tests.helpers.report_runs import ingest_steps  # noqa: E402
from timwatch.monitor.report import build_report, figcache  # noqa: E402
from timwatch.monitor.store import Store  # noqa: E402


def timed(store: Store, run: str, repeat: int, clear: bool) -> list[float]:
    out = []
    for _ in range(repeat):
        if clear:
            figcache.CACHE.clear()
        t = time.perf_counter()
        build_report(store, run)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=4)
    bench_json.add_argument(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/report.db", sqlite_synchronous="OFF")
        try:
            ingest_steps(store, "r", args.steps)
            build_report(store, "r")  # matplotlib and fonts loaded
            drawn = timed(store, "r", args.repeat, clear=True)
            reused = timed(store, "r", args.repeat, clear=False)
        finally:
            store.close()
    d, r = statistics.median(drawn), statistics.median(reused)
    print(f"{args.steps}-step run, median of {args.repeat}:")
    print(f"  figures drawn   {d:6.3f} s (best {min(drawn):.3f})")
    print(f"  figures reused  {r:6.3f} s (best {min(reused):.3f})   {d / r:.0f}x faster")
    bench_json.write(
        args.json, "report_cost",
        {f"{args.steps}-step page, figures drawn, s": d,
         f"{args.steps}-step page, figures reused, s": r},
        {"drawn / reused": d / r}, note=f"median of {args.repeat}",
    )  # fmt: skip


if __name__ == "__main__":
    main()
