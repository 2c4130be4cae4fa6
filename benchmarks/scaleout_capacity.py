"""Scale-out capacity: throughput through HAProxy with 1, 2 and 3 replicas on one PostgreSQL,
the CPU each part spends per batch, scrape cost per replica with 1,000 live runs, the PostgreSQL
write cost per batch, and what a 1,000-GPU lab would need.

    python benchmarks/scaleout_capacity.py [--pg-url URL] [--load-s 10] [--producers 16]
    python benchmarks/scaleout_capacity.py --scrapes-only    # part 2 alone

`--pg-url` (default ``$TIMWATCH_TEST_PG_URL``; `bash .ci/start-postgres.sh` prints one) names a
PostgreSQL server this benchmark may create scratch databases on, on this machine (its CPU is
read from /proc). Bounded: about two minutes (a hard deadline stops it at 420 s). Prints:

1. For N = 1, 2, 3 replicas behind HAProxy (deploy/scaleout/haproxy.cfg, as the stack test runs
   it): `--producers` closed-loop threads post batches of `--tokens` tokens (4 ranks per run)
   for `--load-s` seconds; batches/s, tokens/s, the ratio to 1 replica, and CPU seconds per
   batch of the replicas, PostgreSQL (all its processes), HAProxy and the producers. The part
   with the most CPU per batch is the bottleneck once the machine's cores are all busy.
2. One replica holding 1,000 live runs (behind the balancer every replica holds every run its
   share of batches touched): a scrape's size, the first one's time, then p50 and max.
3. PostgreSQL per batch: WAL bytes and database growth.
4. A 1,000-GPU lab sized from these figures (assumptions printed with it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_json  # noqa: E402

from tests.helpers.pg import fresh_database  # noqa: E402
from tests.helpers.procs import free_port  # noqa: E402
from tests.helpers.scaleout import haproxy_config  # noqa: E402
from timwatch.monitor.core.batch import Batch  # noqa: E402

SAFETENSORS = {"Content-Type": "application/x-safetensors"}
DEADLINE = time.monotonic() + 420.0
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, children: bool = False) -> float:
    """CPU seconds of `pid` (plus its reaped children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / TICKS


def make_batch(seed: int, tokens: int) -> Batch:
    rng = np.random.default_rng(seed)
    seq = 256
    cu = np.arange(0, tokens + 1, seq, dtype=np.int64)
    mu = -rng.exponential(1.0, tokens).astype(np.float32)
    pi = np.minimum(mu + rng.normal(0, 0.02, tokens).astype(np.float32), 0).astype(np.float32)
    return Batch.from_arrays(
        cu_seqlens=cu, logp_rollout=mu, logp_train=pi,
        entropy=rng.exponential(1.0, tokens).astype(np.float32),
        loss_mask=np.ones(tokens, dtype=np.uint8), step=0, batch_id="x",
    )  # fmt: skip


class Replicas:
    """N `timwatch serve` processes on `db` behind one HAProxy."""

    def __init__(self, db: str, n: int, tmp: Path) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "timwatch", "serve", "--port", str(p), "--db", db,
                 "--log-level", "warning", "--run-ttl", "1e9"],
                cwd=REPO, stdout=(tmp / f"r{p}.log").open("wb"), stderr=subprocess.STDOUT,
            )
            for p in self.ports
        ]  # fmt: skip
        for p, proc in zip(self.ports, self.procs, strict=True):
            wait_ok(f"http://127.0.0.1:{p}/healthz", proc)
        lb = free_port()
        cfg = tmp / f"haproxy-{n}.cfg"
        servers = {f"timwatch-{k + 1}": f"127.0.0.1:{p}" for k, p in enumerate(self.ports)}
        cfg.write_text(haproxy_config(f"127.0.0.1:{lb}", servers))
        exe = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
        assert exe, "install the Debian package haproxy"
        self.haproxy = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                                        stderr=(tmp / "haproxy.log").open("ab"))  # fmt: skip
        self.url = f"http://127.0.0.1:{lb}"
        wait_ok(f"{self.url}/healthz")
        time.sleep(1.0)  # every server passed its first check

    def cpu(self) -> tuple[float, float]:
        return sum(cpu_s(p.pid) for p in self.procs), cpu_s(self.haproxy.pid)

    def stop(self) -> None:
        for p in [*self.procs, self.haproxy]:
            p.terminate()
        for p in [*self.procs, self.haproxy]:
            p.wait(30)


def wait_ok(url: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    while time.monotonic() < DEADLINE:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the process behind {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} never answered 200")


def postmaster(db: str) -> tuple[int, str]:
    from sqlalchemy import create_engine, text

    engine = create_engine(db)
    with engine.connect() as conn:
        data = conn.execute(text("SHOW data_directory")).scalar_one()
    engine.dispose()
    return int((Path(data) / "postmaster.pid").read_text().split()[0]), data


def pg_figures(db: str) -> tuple[int, int]:
    """(WAL position in bytes, database size in bytes)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db)
    with engine.connect() as conn:
        wal = conn.execute(text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one()
        size = conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
    engine.dispose()
    return int(wal), int(size)


def load(url: str, producers: int, tokens: int, seconds: float) -> Counter[int]:
    """Closed-loop producers (4 ranks per run), each posting its own batches until time is up."""
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def go(k: int) -> None:
        base = make_batch(k, tokens)
        run, rank, step = f"cap-{k // 4}", k % 4, 0
        with httpx.Client(base_url=url, timeout=60) as c:
            while time.monotonic() < stop:
                b = dataclasses.replace(base, step=step, batch_id=f"{run}-{step}-{rank}")
                try:
                    body = b.to_safetensors()
                    answer = c.post(f"/v1/runs/{run}/batches", content=body, headers=SAFETENSORS)
                    r: httpx.Response | None = answer
                    code = answer.status_code
                except httpx.HTTPError:
                    code, r = 0, None
                with lock:
                    statuses[code] += 1
                step += code == 200
                if code != 200:  # back off as the tap does (Retry-After, at most 1 s)
                    after = r.headers.get("Retry-After", "1") if r is not None else "1"
                    time.sleep(min(float(after), 1.0))

    threads = [threading.Thread(target=go, args=(k,)) for k in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


# rows for --json, appended as each part prints
ROWS: list[dict[str, object]] = []
FIGURES: dict[str, object] = {}


def throughput(pg_url: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    print(f"1. throughput through HAProxy, {args.producers} producers, {args.tokens}-token "
          f"batches, {args.load_s:.0f} s per configuration")  # fmt: skip
    print("   replicas  batches/s  tokens/s   ratio   CPU ms per batch: replicas  postgres  "
          "haproxy  producers   (load average before)")  # fmt: skip
    base, last = 0.0, {}
    for n in (1, 2, 3):
        load_avg = os.getloadavg()[0]
        with fresh_database("tw_capacity", pg_url) as db:
            pm, _ = postmaster(db)
            reps = Replicas(db, n, tmp)
            try:
                wal0, size0 = pg_figures(db)
                r0, h0 = reps.cpu()
                p0, c0 = cpu_s(pm, children=True), time.process_time()
                t0 = time.monotonic()
                statuses = load(reps.url, args.producers, args.tokens, args.load_s)
                elapsed = time.monotonic() - t0
                r1, h1 = reps.cpu()
                c1 = time.process_time()
                wal1, size1 = pg_figures(db)
            finally:
                reps.stop()
            time.sleep(0.5)  # the backends of the stopped replicas are reaped
            p1 = cpu_s(pm, children=True)
        ok = statuses[200]
        bps = ok / elapsed
        base = base or bps
        per = {k: v / max(ok, 1) * 1e3 for k, v in
               (("rep", r1 - r0), ("pg", p1 - p0), ("lb", h1 - h0), ("cli", c1 - c0))}  # fmt: skip
        others = {k: v for k, v in statuses.items() if k != 200}
        note = f"   load {load_avg:4.1f}" + (f"; other answers: {others}" if others else "")
        print(f"   {n:8d}  {bps:9.1f}  {bps * args.tokens:8.0f}  {bps / base:6.2f}x  "
              f"{per['rep']:24.1f}  {per['pg']:8.1f}  {per['lb']:7.2f}  {per['cli']:9.1f}"
              f"{note}")  # fmt: skip
        ROWS.append({
            "replicas": n, "batches/s": bps, "tokens/s": bps * args.tokens, "vs 1": bps / base,
            "CPU ms per batch: replicas": per["rep"], "PostgreSQL": per["pg"],
            "HAProxy": per["lb"], "producers": per["cli"], "load average": load_avg,
        })  # fmt: skip
        last = {"bps": bps, "rep_ms": per["rep"], "pg_ms": per["pg"],
                "wal": (wal1 - wal0) / max(ok, 1),
                "size": (size1 - size0) / max(ok, 1)}  # fmt: skip
    print(f"   this machine: {os.cpu_count()} cores shared with other work; every configuration "
          "saturates them, so the ratios show contention, not a replica limit")  # fmt: skip
    return last


def scrapes(pg_url: str, tmp: Path, runs: int) -> tuple[float, int]:
    """Scrape cost of one replica holding `runs` live runs: behind the balancer every replica
    holds every run its share of batches touched, so this is the cost per replica."""
    with fresh_database("tw_capacity", pg_url) as db:
        reps = Replicas(db, 1, tmp)
        try:
            b = make_batch(7, 256)
            port = reps.ports[0]

            def populate(first: int) -> None:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                    for r in range(first, runs, 8):
                        x = dataclasses.replace(b, step=0, batch_id=f"{r}")
                        c.post(f"/v1/runs/s-{r:04d}/batches", content=x.to_safetensors(),
                               headers=SAFETENSORS)  # fmt: skip
                        if time.monotonic() > DEADLINE - 30:
                            return

            threads = [threading.Thread(target=populate, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times = []
            for _ in range(21):
                t0 = time.perf_counter()
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
                times.append(time.perf_counter() - t0)
            first, rest = times[0], sorted(times[1:])
            held = text.count("timwatch_batches_total{")
            if held < runs:
                raise SystemExit(f"the replica holds {held} runs of {runs}: out of time")
            print(f"2. scrape cost per replica holding {runs} live runs: "
                  f"{len(text) / 1e6:5.2f} MB, {text.count(chr(10))} lines; "
                  f"first scrape {first * 1e3:6.1f} ms, then p50 {rest[10] * 1e3:6.1f} ms, "
                  f"max {rest[-1] * 1e3:6.1f} ms")  # fmt: skip
            FIGURES[f"scrape of a replica holding {runs:,} runs, MB"] = len(text) / 1e6
            FIGURES[f"scrape of a replica holding {runs:,} runs, p50 ms"] = rest[10] * 1e3
            return rest[10], len(text)
        finally:
            reps.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg-url", default=os.environ.get("TIMWATCH_TEST_PG_URL"))
    ap.add_argument("--load-s", type=float, default=10.0)
    ap.add_argument("--producers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--scrapes-only", action="store_true", help="only part 2 (scrape cost)")
    bench_json.add_argument(ap)
    args = ap.parse_args()
    if not args.pg_url:
        raise SystemExit("--pg-url (or TIMWATCH_TEST_PG_URL) is required")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.scrapes_only:
            scrapes(args.pg_url, tmp, args.runs)
            bench_json.write(args.json, "scaleout_capacity", FIGURES, {}, ROWS)
            return
        fig = throughput(args.pg_url, args, tmp)
        print("3. PostgreSQL per batch (3 replicas): "
              f"CPU {fig['pg_ms']:.1f} ms, WAL {fig['wal'] / 1e3:.1f} kB, "
              f"database growth {fig['size'] / 1e3:.1f} kB")  # fmt: skip
        FIGURES["PostgreSQL per batch (3 replicas): CPU, ms"] = fig["pg_ms"]
        FIGURES["PostgreSQL per batch (3 replicas): WAL, kB"] = fig["wal"] / 1e3
        FIGURES["PostgreSQL per batch (3 replicas): database growth, kB"] = fig["size"] / 1e3
        scrape_s, scrape_bytes = scrapes(args.pg_url, tmp, args.runs)
    lab(fig, args.tokens, scrape_s, scrape_bytes)
    bench_json.write(
        args.json, "scaleout_capacity", FIGURES, {}, ROWS,
        note="every configuration shares the host's cores: CPU per batch carries over, "
        "batches/s does not",
    )  # fmt: skip


def lab(fig: dict[str, float], tokens: int, scrape_s: float, scrape_bytes: int) -> None:
    gpus, step_s, tok_per_gpu = 1000, 60.0, 32768
    batches = gpus / step_s  # one batch per trainer rank (GPU) per step
    scale = tok_per_gpu / tokens  # CPU per batch grows with its tokens (kernel-bound)
    rep_cores = batches * fig["rep_ms"] * scale / 1e3
    pg_cores = batches * fig["pg_ms"] / 1e3
    print(f"4. a 1,000-GPU lab: one batch of {tok_per_gpu} tokens per GPU per {step_s:.0f} s "
          f"step = {batches:.1f} batches/s, "
          f"{batches * tok_per_gpu / 1e3:.0f}k tokens/s")  # fmt: skip
    print(f"   replica CPU {rep_cores:.1f} cores (replica CPU per batch scaled by tokens "
          f"{scale:.0f}x) -> {max(2, round(rep_cores * 2 + 0.5))} replicas of 1 core at 50% "
          "load (2 at least, for one to fail)")  # fmt: skip
    print(f"   PostgreSQL CPU {pg_cores:.2f} cores, WAL {batches * fig['wal'] * 86400 / 1e9:.1f} "
          f"GB/day, growth {batches * fig['size'] * 86400 / 1e9:.1f} GB/day (per-batch costs "
          "do not grow with tokens: a step row and a batch row)")  # fmt: skip
    print(f"   scrapes: each replica holds every run; {scrape_bytes / 1e6:.1f} MB in "
          f"{scrape_s * 1e3:.0f} ms per 1,000 runs at a 15 s interval")  # fmt: skip


if __name__ == "__main__":
    main()
