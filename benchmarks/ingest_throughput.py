"""End-to-end ingest throughput and history query latency of a real timwatch server.

    python benchmarks/ingest_throughput.py [--tokens 1048576] [--pg-url URL]

1. Ingest: tokens/s over loopback, safetensors vs JSON, 1 and 8 concurrent clients, against a
   `timwatch serve` subprocess on SQLite. Ratios are against JSON measured in the same run.
2. Query: p50/p95 of `GET /v1/runs/{run}/metrics?names=mismatch_kl,is_ratio_std` over a run
   with 100k steps, on SQLite and (with --pg-url or TIMWATCH_TEST_PG_URL) PostgreSQL.
3. SQLite commit cost of synchronous=FULL vs NORMAL per batch (why FULL is the default).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_json  # noqa: E402

from timwatch.monitor.core.batch import Batch  # noqa: E402
from timwatch.monitor.core.jsoncodec import dumps  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, db: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "TIMWATCH_TOKEN"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "timwatch", "serve", "--port", str(self.port),
             "--db", db, "--log-level", "warning"],
            cwd=REPO, env=env,
        )  # fmt: skip
        for _ in range(600):
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def make_batch(tokens: int, step: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    seq = 4096
    cu = np.arange(0, tokens + 1, seq, dtype=np.int64)
    if cu[-1] != tokens:
        cu = np.append(cu, tokens)
    mu = -rng.exponential(1.0, tokens).astype(np.float32)
    pi = np.minimum(mu + rng.normal(0, 0.02, tokens).astype(np.float32), 0).astype(np.float32)
    ent = rng.exponential(1.0, tokens).astype(np.float32)
    mask = (rng.random(tokens) > 0.1).astype(np.uint8)
    return Batch.from_arrays(
        cu_seqlens=cu, logp_rollout=mu, logp_train=pi, entropy=ent, loss_mask=mask, step=step
    )


def ingest(url: str, bodies: list[bytes], ctype: str, clients: int, per_client: int) -> float:
    """Seconds for `clients` threads each posting `per_client` bodies."""
    errors: list[str] = []
    barrier = threading.Barrier(clients + 1)

    def work(i: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            barrier.wait()
            for j in range(per_client):
                body = bodies[(i + j) % len(bodies)]
                r = c.post("/v1/runs/bench/batches", content=body, headers={"Content-Type": ctype})
                if r.status_code != 200:
                    errors.append(r.text[:200])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    return elapsed


# rows and figures for --json, appended by each part as it prints
ROWS: list[dict[str, object]] = []
FIGURES: dict[str, object] = {}
RATIOS: dict[str, float] = {}


def bench_ingest(tokens: int, seconds: float) -> None:
    tmp = tempfile.mkdtemp(prefix="tw-bench-")
    srv = Server(f"sqlite:///{tmp}/ingest.db")
    try:
        batches = [make_batch(tokens, step=s, seed=s) for s in range(4)]
        st = [b.to_safetensors() for b in batches]
        js = [dumps(b.to_json()) for b in batches]
        print(f"batch: {tokens} tokens; safetensors {len(st[0]) / 1e6:.1f} MB, "
              f"JSON {len(js[0]) / 1e6:.1f} MB")  # fmt: skip
        ingest(srv.url, st[:1], "application/x-safetensors", 1, 2)  # warm-up (JIT, pages)
        ingest(srv.url, js[:1], "application/json", 1, 1)
        rates: dict[tuple[str, int], float] = {}
        for name, bodies, ctype in (
            ("safetensors", st, "application/x-safetensors"),
            ("json", js, "application/json"),
        ):
            for clients in (1, 8):
                probe = ingest(srv.url, bodies, ctype, 1, 1)
                per_client = max(1, int(seconds / probe / clients))
                elapsed = ingest(srv.url, bodies, ctype, clients, per_client)
                n = clients * per_client
                rates[(name, clients)] = n * tokens / elapsed
                print(f"  {name:11s} clients={clients}: {n:3d} batches in {elapsed:6.2f} s → "
                      f"{rates[(name, clients)] / 1e6:7.2f} M tokens/s "
                      f"({elapsed / per_client * 1e3:7.1f} ms per batch per client)")  # fmt: skip
                ROWS.append({
                    "what": f"ingest {name}, {clients} client(s)",
                    "tokens/s": rates[(name, clients)],
                    "ms per batch per client": elapsed / per_client * 1e3,
                })  # fmt: skip
        for clients in (1, 8):
            ratio = rates[("safetensors", clients)] / rates[("json", clients)]
            print(f"  safetensors/JSON with {clients} client(s): {ratio:.1f}x")
            RATIOS[f"safetensors / JSON tokens/s, {clients} client(s)"] = ratio
        FIGURES["safetensors ingest, 1 client, tokens/s"] = rates[("safetensors", 1)]
    finally:
        srv.stop()


def fill_steps(db: str, run: str, steps: int) -> None:
    """Write `steps` synthetic step rows straight into the store (the query is what we time)."""
    from sqlalchemy import insert

    from timwatch.monitor.store import Store
    from timwatch.monitor.store.models import COUNT_COLUMNS, FLOAT_COLUMNS, Run, steps_table
    from timwatch.monitor.store.series import backfill

    store = Store(db)
    rng = random.Random(0)
    now = time.time()
    with store.engine.begin() as conn:
        conn.execute(
            insert(Run.__table__).values(
                id=run, first_seen=now, last_seen=now, last_step=steps - 1, tags={}
            )
        )
        chunk = 5000
        for start in range(0, steps, chunk):
            rows = []
            for s in range(start, min(steps, start + chunk)):
                row: dict[str, object] = {
                    "run_id": run, "step": s, "updated_at": now, "batches": 8,
                    "policy_version": s, "entropy_source": "trainer",
                }  # fmt: skip
                row.update({c: rng.randint(1, 10**6) for c in COUNT_COLUMNS})
                row.update({c: rng.random() for c in FLOAT_COLUMNS})
                rows.append(row)
            conn.execute(insert(steps_table), rows)
        backfill(conn, runs=[run])  # bulk rows bypass record_batch: build the series chunks
    store.close()


def bench_query(db: str, label: str, steps: int, repeats: int) -> None:
    run = f"q{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()
    fill_steps(db, run, steps)
    fill = time.perf_counter() - t0
    srv = Server(db)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            params = {"names": "mismatch_kl,is_ratio_std"}
            r = c.get(f"/v1/runs/{run}/metrics", params=params)
            assert r.status_code == 200 and len(r.json()["steps"]) == steps, r.text[:200]
            lat = []
            for _ in range(repeats):
                t = time.perf_counter()
                r = c.get(f"/v1/runs/{run}/metrics", params=params)
                r.raise_for_status()
                lat.append((time.perf_counter() - t) * 1e3)
            lat_last = []
            for _ in range(repeats):
                t = time.perf_counter()
                c.get(f"/v1/runs/{run}/metrics", params={**params, "last": 1000}).raise_for_status()
                lat_last.append((time.perf_counter() - t) * 1e3)
    finally:
        srv.stop()
    q = statistics.quantiles(lat, n=20)
    ql = statistics.quantiles(lat_last, n=20)
    print(f"  {label}: {steps} steps (filled in {fill:.1f} s), 2 series, {len(r.content) / 1e6:.1f}"
          f" MB: p50 {statistics.median(lat):.1f} ms, p95 {q[18]:.1f} ms; last=1000: p50 "
          f"{statistics.median(lat_last):.1f} ms, p95 {ql[18]:.1f} ms")  # fmt: skip
    ROWS.append({
        "what": f"{label}: {steps:,}-step metrics query, 2 series",
        "p50, ms": statistics.median(lat), "p95, ms": q[18],
    })  # fmt: skip


def bench_sqlite_sync(n: int = 200) -> None:
    from timwatch.monitor.core.engine import accumulate
    from timwatch.monitor.store import Store

    batch = make_batch(4096, step=0, seed=1)
    acc = accumulate(batch)
    for sync in ("NORMAL", "FULL"):
        tmp = tempfile.mkdtemp(prefix="tw-sync-")
        store = Store(f"sqlite:///{tmp}/s.db", sqlite_synchronous=sync)
        t0 = time.perf_counter()
        for i in range(n):
            store.record_batch(
                "s", step=i, batch_id=None, acc=acc, tokens=4096, respond=lambda row: {}
            )
        dt = (time.perf_counter() - t0) / n * 1e3
        store.close()
        print(f"  synchronous={sync:6s}: {dt:.2f} ms per batch transaction (new step each)")
        ROWS.append({"what": f"SQLite synchronous={sync}: a batch's transaction", "ms": dt})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens per batch")
    ap.add_argument("--seconds", type=float, default=4.0, help="target time per configuration")
    ap.add_argument("--steps", type=int, default=100_000, help="steps for the query benchmark")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--pg-url", default=os.environ.get("TIMWATCH_TEST_PG_URL"))
    ap.add_argument("--skip-ingest", action="store_true")
    bench_json.add_argument(ap)
    args = ap.parse_args()

    if not args.skip_ingest:
        print("ingest (loopback, SQLite store):")
        bench_ingest(args.tokens, args.seconds)
    print("metrics query:")
    tmp = tempfile.mkdtemp(prefix="tw-query-")
    bench_query(f"sqlite:///{tmp}/query.db", "SQLite", args.steps, args.repeats)
    if args.pg_url:
        bench_query(args.pg_url, "PostgreSQL", args.steps, args.repeats)
    else:
        print("  PostgreSQL: skipped (no --pg-url / TIMWATCH_TEST_PG_URL)")
    print("SQLite commit cost:")
    bench_sqlite_sync()
    bench_json.write(
        args.json, "ingest_throughput", FIGURES, RATIOS, ROWS,
        note=f"{args.tokens:,}-token batches to a real timwatch serve on loopback",
    )  # fmt: skip


if __name__ == "__main__":
    main()
