"""Serving figures: /metrics cost with 1,000 live runs, and how fast writers fail on a held store.

    python benchmarks/serving.py [--runs 1000] [--producers 64] [--pg-url URL]

Bounded (about a minute on 2 cores; a hard deadline of 170 s stops it). Prints:

1. In process: the full ``prometheus_client`` render of 1,000 runs (what every scrape cost
   before, the baseline) against the incremental `Exposition` with 0 and 5 runs changed per
   scrape; ratios full / incremental.
2. A real ``timwatch serve`` (SQLite) holding 1,000 live runs: scrape p50/p99 idle, then while
   `--producers` threads post a bounded number of batches (10 each); their answers by status.
3. The store locked from another connection (``BEGIN IMMEDIATE``): time from sending a POST to
   its 503, p50/p99/max over 3 rounds of `--producers` concurrent writers; /metrics and /healthz
   latency meanwhile. With ``--pg-url`` the same on a PostgreSQL store (a scratch database on
   that server) whose ``steps`` table another connection holds with ``LOCK TABLE``.
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_json  # noqa: E402

from tests.helpers.pg import fresh_database  # noqa: E402
from timwatch.monitor.core.accumulator import Accumulator  # noqa: E402
from timwatch.monitor.core.batch import Batch  # noqa: E402
from timwatch.monitor.core.engine import accumulate  # noqa: E402
from timwatch.monitor.core.row import derive_row  # noqa: E402
from timwatch.monitor.service.exporter import make_registry, render  # noqa: E402
from timwatch.monitor.service.exposition import Exposition  # noqa: E402
from timwatch.monitor.service.runs import RunRegistry  # noqa: E402

SAFETENSORS = {"Content-Type": "application/x-safetensors"}
DEADLINE = time.monotonic() + 170.0


def batch(seed: int, step: int, batch_id: str | None = None, tokens: int = 256) -> Batch:
    rng = np.random.default_rng(seed)
    cu = np.array([0, tokens // 2, tokens], dtype=np.int64)
    mu = -rng.exponential(1.0, tokens).astype(np.float32)
    pi = np.minimum(mu + rng.normal(0, 0.02, tokens).astype(np.float32), 0).astype(np.float32)
    ent = rng.exponential(1.0, tokens).astype(np.float32)
    mask = np.ones(tokens, dtype=np.uint8)
    return Batch.from_arrays(
        cu_seqlens=cu, logp_rollout=mu, logp_train=pi, entropy=ent, loss_mask=mask, step=step,
        batch_id=batch_id,
    )  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def ms(xs: list[float]) -> str:
    return f"p50 {pct(xs, 0.5) * 1e3:8.2f} ms  p99 {pct(xs, 0.99) * 1e3:8.2f} ms  (n={len(xs)})"


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# rows for --json: one per latency the run prints
ROWS: list[dict[str, object]] = []


def lat_row(what: str, xs: list[float]) -> dict[str, object]:
    return {"what": what, "p50, ms": pct(xs, 0.5) * 1e3, "p99, ms": pct(xs, 0.99) * 1e3,
            "max, ms": max(xs) * 1e3, "n": len(xs)}  # fmt: skip


def in_process(n_runs: int) -> float:
    accs: list[Accumulator] = [accumulate(batch(s, 0)) for s in range(4)]
    runs = RunRegistry(ttl=1e9)
    for r in range(n_runs):
        acc = accs[r % 4]
        runs.observe(f"run-{r:04d}", acc, derive_row(acc).to_dict(), r)
    full_reg, expo = make_registry(runs), Exposition(runs)
    full = timed(lambda: render(full_reg), 5)
    first = timed(expo.render, 1)
    idle = timed(expo.render, 50)
    k = 0

    def changed() -> None:
        nonlocal k
        for _ in range(5):
            k += 1
            acc = accs[k % 4]
            runs.observe(f"run-{k * 7 % n_runs:04d}", acc, derive_row(acc).to_dict(), k)
        expo.render()

    five = timed(changed, 50)
    assert expo.render() == render(full_reg)
    print(f"1. in process, {n_runs} live runs")
    print(f"   full render (baseline)      {ms(full)}")
    ROWS.append(lat_row("in process: full render (baseline)", full))
    print(f"   incremental, first scrape   {ms(first)}")
    ROWS.append(lat_row("in process: incremental, first scrape", first))
    for label, xs in (("0 changed", idle), ("5 changed", five)):
        ratio = pct(full, 0.5) / pct(xs, 0.5)
        print(f"   incremental, {label}      {ms(xs)}   full/incr {ratio:6.1f}x")
        ROWS.append(lat_row(f"in process: incremental, {label}", xs))
    return pct(full, 0.5)


def start_server(db: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "timwatch", "serve", "--port", str(port), "--db", db,
           "--log-level", "warning", "--run-ttl", "1e9"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    while time.monotonic() < DEADLINE:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"server did not come up: {log.read_text()}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rejected(c: httpx.Client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = c.get("/metrics").text
    return {
        s.labels["reason"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "timwatch_rejected_batches_total"
    }


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(after[k] - before[k]) for k in after if after[k] > before[k]}


def populate(url: str, n_runs: int) -> None:
    bodies = [batch(s, 0).to_safetensors() for s in range(4)]

    def one(r: int) -> int:
        with httpx.Client(base_url=url, timeout=60) as c:
            return c.post(f"/v1/runs/run-{r:04d}/batches", content=bodies[r % 4],
                          headers=SAFETENSORS).status_code  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        codes = Counter(pool.map(one, range(n_runs)))
    assert codes == {200: n_runs}, codes


def scrapes_under_load(url: str, n_runs: int, producers: int, full_p50: float) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        first = timed(lambda: c.get("/metrics").raise_for_status(), 1)
        idle = timed(lambda: c.get("/metrics").raise_for_status(), 50)
        before = rejected(c)
    bodies = [batch(100 + s, 1).to_safetensors() for s in range(8)]
    codes: Counter[int] = Counter()
    done = threading.Event()

    def produce(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            for j in range(10):
                r = c.post(f"/v1/runs/run-{(i * 10 + j) % n_runs:04d}/batches",
                           content=bodies[(i + j) % 8], headers=SAFETENSORS)  # fmt: skip
                codes[r.status_code] += 1

    busy: list[float] = []
    with ThreadPoolExecutor(producers) as pool:
        futures = [pool.submit(produce, i) for i in range(producers)]
        with httpx.Client(base_url=url, timeout=60) as c:
            while not all(f.done() for f in futures) and time.monotonic() < DEADLINE:
                busy += timed(lambda: c.get("/metrics").raise_for_status(), 1)
        done.set()
    with httpx.Client(base_url=url, timeout=60) as c:
        after = rejected(c)
    print(f"2. real server, {n_runs} live runs (SQLite)")
    print(f"   /metrics first scrape       {ms(first)}")
    ROWS.append(lat_row("real server: /metrics first scrape", first))
    ratio = full_p50 / pct(idle, 0.5)
    print(f"   /metrics idle               {ms(idle)}   in-process full render/this {ratio:6.1f}x")
    ROWS.append(lat_row("real server: /metrics idle", idle))
    print(f"   /metrics, {producers} producers      {ms(busy)}")
    ROWS.append(lat_row(f"real server: /metrics, {producers} producers", busy))
    print(f"   producer answers: {dict(sorted(codes.items()))} ({producers} x 10 posts)")
    print(f"   refusals by reason: {delta(before, after)}")


@contextmanager
def sqlite_locked(db_path: Path) -> Iterator[None]:
    lock = sqlite3.connect(db_path, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        lock.execute("ROLLBACK")
        lock.close()


@contextmanager
def postgres_locked(db: str) -> Iterator[None]:
    from sqlalchemy import create_engine, text

    other = create_engine(db)
    try:
        with other.connect() as conn, conn.begin():
            conn.execute(text("LOCK TABLE steps IN ACCESS EXCLUSIVE MODE"))
            yield
    finally:
        other.dispose()


def locked_writes(url: str, hold: AbstractContextManager[None], producers: int, what: str) -> None:
    bodies = [batch(200 + s, 5, batch_id=f"lk{s}").to_safetensors() for s in range(producers)]
    to_503: list[float] = []
    codes: Counter[str] = Counter()
    side: list[float] = []
    with hold:
        with httpx.Client(base_url=url, timeout=60) as c:
            before = rejected(c)
        for _round in range(3):
            barrier = threading.Barrier(producers)

            def one(i: int, barrier: threading.Barrier = barrier) -> None:
                with httpx.Client(base_url=url, timeout=60) as c:
                    barrier.wait()
                    t0 = time.perf_counter()
                    r = c.post("/v1/runs/locked/batches", content=bodies[i], headers=SAFETENSORS)
                    dt = time.perf_counter() - t0
                reason = "retry-after" if "Retry-After" in r.headers else "no retry-after"
                codes[f"{r.status_code} {reason}"] += 1
                if r.status_code == 503:
                    to_503.append(dt)

            with ThreadPoolExecutor(producers) as pool:
                futures = [pool.submit(one, i) for i in range(producers)]
                with httpx.Client(base_url=url, timeout=60) as c:
                    while not all(f.done() for f in futures):
                        side += timed(lambda: c.get("/metrics"), 1)
                        side += timed(lambda: c.get("/healthz"), 1)
                for f in futures:
                    f.result()
        with httpx.Client(base_url=url, timeout=60) as c:
            after = rejected(c)
    print(f"3. {what} held by another connection, {producers} concurrent writers x 3")
    print(f"   time to 503                 {ms(to_503)}  max {max(to_503) * 1e3:.1f} ms")
    ROWS.append(lat_row(f"{what}: time to 503", to_503))
    print(f"   answers: {dict(codes)}")
    print(f"   by reason: {delta(before, after)}")
    print(f"   /metrics + /healthz meanwhile {ms(side)}")
    ROWS.append(lat_row(f"{what}: /metrics + /healthz meanwhile", side))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--producers", type=int, default=64)
    ap.add_argument("--pg-url", help="also lock a PostgreSQL store (a scratch database on it)")
    bench_json.add_argument(ap)
    args = ap.parse_args()
    full_p50 = in_process(args.runs)
    with tempfile.TemporaryDirectory() as tmp:
        db_path = Path(tmp) / "serving.db"
        port = free_port()
        proc = start_server(f"sqlite:///{db_path}", port, Path(tmp) / "server.log")
        url = f"http://127.0.0.1:{port}"
        try:
            populate(url, args.runs)
            scrapes_under_load(url, args.runs, args.producers, full_p50)
            locked_writes(url, sqlite_locked(db_path), args.producers, "SQLite write lock")
        finally:
            proc.terminate()
            proc.wait(30)
        if args.pg_url:
            with fresh_database("tw_serving", args.pg_url) as db:
                port = free_port()
                proc = start_server(db, port, Path(tmp) / "server-pg.log")
                url = f"http://127.0.0.1:{port}"
                try:
                    populate(url, 10)
                    what = "PostgreSQL LOCK TABLE steps (ACCESS EXCLUSIVE)"
                    locked_writes(url, postgres_locked(db), args.producers, what)
                finally:
                    proc.terminate()
                    proc.wait(30)
    bench_json.write(
        args.json, "serving", {}, {}, ROWS,
        note=f"{args.runs:,} live runs, {args.producers} producers",
    )  # fmt: skip


if __name__ == "__main__":
    main()
