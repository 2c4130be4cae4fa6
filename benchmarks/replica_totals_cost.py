"""What ``timwatch serve --replica-id`` costs per batch in the store: the batch's transaction
also merges its accumulator into the replica's (replica, run) totals row (`store.totals`).

    python benchmarks/replica_totals_cost.py [--pg-url URL] [--batches 240] [--rounds 6]
    python benchmarks/replica_totals_cost.py --sqlite          # the same on a SQLite file

One `Store` in this process records the same 4,096-token batches (8 per step, as 8 trainer
ranks) without and with a replica id, alternating in `--rounds` rounds so load drift on a
shared machine hits both alike (each mode its own run). Per batch, medians over the rounds:
wall time of `Store.record_batch`, this process' CPU in it, PostgreSQL's CPU (the postmaster
and every backend, from /proc), WAL bytes and database growth; then the ratio with / without.
The metric kernel is not in the figures (accumulators are computed beforehand): this is the
write path alone, which is where the totals row adds work. Bounded: about a minute.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_json  # noqa: E402

from tests.helpers.pg import fresh_database  # noqa: E402
from timwatch.monitor.core.accumulator import Accumulator  # noqa: E402
from timwatch.monitor.core.batch import Batch  # noqa: E402
from timwatch.monitor.core.engine import accumulate  # noqa: E402
from timwatch.monitor.store import Store  # noqa: E402
from timwatch.monitor.store.totals import Tally  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
RANKS = 8


def make_acc(seed: int, tokens: int = 4096) -> Accumulator:
    rng = np.random.default_rng(seed)
    cu = np.arange(0, tokens + 1, 256, dtype=np.int64)
    mu = -rng.exponential(1.0, tokens).astype(np.float32)
    pi = np.minimum(mu + rng.normal(0, 0.02, tokens).astype(np.float32), 0).astype(np.float32)
    return accumulate(
        Batch.from_arrays(
            cu_seqlens=cu, logp_rollout=mu, logp_train=pi,
            entropy=rng.exponential(1.0, tokens).astype(np.float32),
            loss_mask=np.ones(tokens, dtype=np.uint8), step=0, batch_id="x",
        )
    )  # fmt: skip


def pg_cpu(postmaster: int) -> float:
    """CPU seconds of the postmaster, its live children and its reaped ones."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            f = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry.name), int(f[1])
        if pid == postmaster:
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
        elif ppid == postmaster:
            total += int(f[11]) + int(f[12])
    return total / TICKS


class Pg:
    def __init__(self, store: Store) -> None:
        from sqlalchemy import text

        self.store, self.text = store, text
        with store.engine.connect() as conn:
            data = conn.execute(text("SHOW data_directory")).scalar_one()
        self.pid = int((Path(data) / "postmaster.pid").read_text().split()[0])

    def figures(self) -> tuple[float, int, int]:
        """(CPU s, WAL position bytes, database bytes)."""
        with self.store.engine.connect() as conn:
            wal = conn.execute(self.text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"))
            size = conn.execute(self.text("SELECT pg_database_size(current_database())"))
            w, s = int(wal.scalar_one()), int(size.scalar_one())
        return pg_cpu(self.pid), w, s


def measure(store: Store, pg: Pg | None, args: argparse.Namespace) -> dict[str, list[float]]:
    accs = [make_acc(k) for k in range(RANKS)]
    out: dict[str, list[float]] = {}
    per_round = args.batches // args.rounds
    for r in range(args.rounds):
        for mode in ("none", "replica") if r % 2 == 0 else ("replica", "none"):
            run = f"cost-{mode}"
            first = r * per_round
            pg0 = pg.figures() if pg else (0.0, 0, 0)
            wall = cpu = 0.0
            for i in range(first, first + per_round):
                tally = Tally("bench-1") if mode == "replica" else None
                t0, c0 = time.perf_counter(), time.process_time()
                store.record_batch(
                    run, step=i // RANKS, batch_id=f"{run}-{i}", acc=accs[i % RANKS],
                    tokens=4096, respond=lambda row: {"step_row": row}, tally=tally,
                )  # fmt: skip
                wall += time.perf_counter() - t0
                cpu += time.process_time() - c0
            pg1 = pg.figures() if pg else (0.0, 0, 0)
            for key, value in (
                ("wall_ms", wall * 1e3), ("py_cpu_ms", cpu * 1e3),
                ("pg_cpu_ms", (pg1[0] - pg0[0]) * 1e3), ("wal_kb", (pg1[1] - pg0[1]) / 1e3),
                ("growth_kb", (pg1[2] - pg0[2]) / 1e3),
            ):  # fmt: skip
                out.setdefault(f"{mode}.{key}", []).append(value / per_round)
    return out


def report(figs: dict[str, list[float]], backend: str, pg: bool, path: Any = None) -> None:
    keys = ["wall_ms", "py_cpu_ms"] + (["pg_cpu_ms", "wal_kb", "growth_kb"] if pg else [])
    rows: list[dict[str, object]] = []
    print(f"per batch on {backend} (median of rounds)   without id   --replica-id   ratio")
    for k in keys:
        a, b = statistics.median(figs[f"none.{k}"]), statistics.median(figs[f"replica.{k}"])
        ratio = f"{b / a:5.2f}x" if a > 0 else "   -"
        print(f"   {k:34s} {a:10.2f}   {b:12.2f}   {ratio}")
        rows.append({"per batch": k, "without id": a, "--replica-id": b,
                     "ratio": b / a if a > 0 else "-"})  # fmt: skip
    print(f"   load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
    bench_json.write(path, "replica_totals_cost", {}, {}, rows, note=f"{backend}, median of rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg-url", default=os.environ.get("TIMWATCH_TEST_PG_URL"))
    ap.add_argument("--sqlite", action="store_true", help="a SQLite file instead")
    ap.add_argument("--batches", type=int, default=240, help="per mode")
    ap.add_argument("--rounds", type=int, default=6)
    bench_json.add_argument(ap)
    args = ap.parse_args()
    if args.sqlite:
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(f"sqlite:///{tmp}/cost.db")
            try:
                report(measure(store, None, args), "SQLite", False, args.json)
            finally:
                store.close()
        return
    if not args.pg_url:
        raise SystemExit("--pg-url or TIMWATCH_TEST_PG_URL (bash .ci/start-postgres.sh)")
    with fresh_database("tw_totals_cost", args.pg_url) as db:
        store = Store(db)
        try:
            pg: Any = Pg(store)
            report(measure(store, pg, args), "PostgreSQL", True, args.json)
        finally:
            store.close()


if __name__ == "__main__":
    main()
