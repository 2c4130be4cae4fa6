"""Cost of the columnar series chunks: per-batch transaction time and 100k-step read time.

For each chunk size, a fresh store takes ``--batches`` small batches through ``record_batch``
(a new step each, then every step again so batches of one step merge) and the time per batch
transaction is compared with the same run with chunk writes switched off (the baseline, measured
in the same process). Then ``--steps`` synthetic steps are bulk-filled and the two-series read
(``query_series`` + orjson) is timed against the row scan (``query_metrics`` + orjson).

    python benchmarks/series_chunks.py [--pg-url URL] [--chunks 64,128,256,512,1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_json  # noqa: E402
from ingest_throughput import fill_steps, make_batch  # noqa: E402

import timwatch.monitor.store.series as series  # noqa: E402
import timwatch.monitor.store.writes as writes  # noqa: E402
from timwatch.monitor.core.engine import accumulate  # noqa: E402
from timwatch.monitor.core.jsoncodec import dumps  # noqa: E402
from timwatch.monitor.store import Store  # noqa: E402

NAMES = ["mismatch_kl", "is_ratio_std"]


def per_batch_ms(url: str, n: int, *, chunks: bool) -> tuple[float, float]:
    """ms per batch transaction: new steps, then a second batch of each step (merge)."""
    acc = accumulate(make_batch(4096, step=0, seed=1))
    real = writes.write_series
    if not chunks:
        writes.write_series = lambda *a, **k: None  # type: ignore[assignment]
    try:
        store = Store(url)
        run = f"w{uuid.uuid4().hex[:6]}"
        out = []
        for _ in range(2):
            t0 = time.perf_counter()
            for i in range(n):
                store.record_batch(
                    run, step=i, batch_id=None, acc=acc, tokens=4096, respond=lambda row: {}
                )
            out.append((time.perf_counter() - t0) / n * 1e3)
        store.close()
    finally:
        writes.write_series = real
    return out[0], out[1]


def read_ms(url: str, steps: int, repeats: int) -> tuple[float, float, float, float]:
    run = f"q{uuid.uuid4().hex[:6]}"
    fill_steps(url, run, steps)
    store = Store(url)

    def timed(fn: Any) -> list[float]:
        lat = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            s, cols = fn(run, NAMES)
            dumps({"run": run, "steps": s, "series": cols})
            lat.append((time.perf_counter() - t0) * 1e3)
        return lat

    rows, cols = timed(store.query_metrics), timed(store.query_series)
    store.close()
    p95 = lambda x: statistics.quantiles(x, n=20)[18]  # noqa: E731
    return statistics.median(rows), p95(rows), statistics.median(cols), p95(cols)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg-url", default=os.environ.get("TIMWATCH_TEST_PG_URL"))
    ap.add_argument("--chunks", default="64,128,256,512,1024")
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=20)
    bench_json.add_argument(ap)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    stores = [("SQLite", None)] + ([("PostgreSQL", args.pg_url)] if args.pg_url else [])
    for label, pg in stores:
        tmp = tempfile.mkdtemp(prefix="tw-series-")
        base_new, base_merge = per_batch_ms(pg or f"sqlite:///{tmp}/base.db", args.batches,
                                            chunks=False)  # fmt: skip
        print(f"{label}: per batch without chunks: new step {base_new:.2f} ms, "
              f"merge {base_merge:.2f} ms")  # fmt: skip
        for size in (int(c) for c in args.chunks.split(",")):
            series.CHUNK = size
            url = pg or f"sqlite:///{tmp}/c{size}.db"
            new, merge = per_batch_ms(url, args.batches, chunks=True)
            r50, r95, c50, c95 = read_ms(url, args.steps, args.repeats)
            print(f"  CHUNK={size:5d}: per batch new {new:.2f} ms ({new / base_new:.2f}x), "
                  f"merge {merge:.2f} ms ({merge / base_merge:.2f}x); {args.steps} steps, "
                  f"2 series + orjson: rows p50 {r50:.1f}/p95 {r95:.1f} ms, chunks p50 "
                  f"{c50:.1f}/p95 {c95:.1f} ms ({r50 / c50:.1f}x)")  # fmt: skip
            rows.append({
                "store": label, "chunk": size,
                "per batch, new step, ms": new, "new step / without chunks": new / base_new,
                "per batch, merge, ms": merge, "merge / without chunks": merge / base_merge,
                "read from rows p50, ms": r50, "read from chunks p50, ms": c50,
                "read from chunks p95, ms": c95, "rows p50 / chunks p50": r50 / c50,
            })  # fmt: skip
    bench_json.write(
        args.json, "series_chunks", {}, {}, rows,
        note=f"{args.steps:,}-step reads of 2 series, {args.repeats} repeats; "
        f"{args.batches} batches per write figure",
    )  # fmt: skip


if __name__ == "__main__":
    main()
