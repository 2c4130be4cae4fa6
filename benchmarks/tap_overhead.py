"""What `Tap.report()` costs the training loop, against a plain `queue.put` in the same run.

A real `timwatch serve` runs on loopback and the tap ships to it in the background while the
calls are timed, so the shipper thread's GIL share is part of the measurement. For each payload
(numpy arrays, CPU torch tensors with bf16 log-probs, CUDA tensors when a GPU is present) it
prints p50/p99 of `report()` and of the baseline `queue.put` of the same dict, and the ratio.
The tap's queue is sized so nothing is dropped; the summary says how many batches were sent.

Two modes: ``paced`` calls once per simulated training step (``--pace-ms`` of GIL-free waiting,
as a trainer waiting on its GPU), so the shipper usually finishes between calls; ``burst``
calls back to back while the shipper is saturated. In burst mode the p99 shows CPython's GIL
hand-off (up to ``sys.getswitchinterval()`` = 5 ms) whenever report() releases the GIL during a
copy and the busy shipper takes it.

    python benchmarks/tap_overhead.py [--calls 2000] [--tokens 4096,32768]
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_json  # noqa: E402
from timwatch.sidecar.tap import Tap  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server(db: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TIMWATCH_TOKEN", None)
    cmd = [sys.executable, "-m", "timwatch", "serve", "--port", str(port),
           "--db", db, "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")


def payload(n: int, kind: str, seq_len: int = 512) -> dict[str, Any]:
    """`n` tokens in sequences of `seq_len` as a trainer reports them: numpy arrays, or CPU
    (``torch``) or ``cuda`` tensors with bf16 trainer log-probs and a bool mask."""
    rng = np.random.default_rng(n)
    seqs = max(1, n // seq_len)
    cu = np.linspace(0, n, seqs + 1).astype(np.int64)
    mu = -rng.exponential(1.0, n)
    arrays: dict[str, Any] = {
        "cu_seqlens": cu,
        "logp_rollout": mu.astype(np.float32),
        "logp_train": (mu + rng.normal(0, 1e-3, n)).clip(max=0).astype(np.float32),
        "entropy": rng.exponential(1.0, n).astype(np.float32),
        "loss_mask": np.ones(n, np.int8),
        "token_ids": rng.integers(0, 150_000, n),
    }
    if kind == "numpy":
        return arrays
    import torch

    out = {k: torch.from_numpy(v) for k, v in arrays.items()}
    out["logp_train"] = out["logp_train"].bfloat16()
    out["loss_mask"] = out["loss_mask"].bool()
    if kind == "cuda":
        out = {k: v.cuda() for k, v in out.items()}
    return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs), q))


def _measure(url: str, kind: str, n: int, calls: int, pace_ms: float) -> dict[str, Any]:
    arrays = payload(n, kind)
    tap = Tap(url, f"bench-{kind}-{n}", queue_size=calls + 10, rank=0)
    q: queue.Queue[Any] = queue.Queue()
    sync = None
    if kind == "cuda":
        import torch

        sync = torch.cuda.synchronize
    report_us, put_us = [], []
    for i in range(calls):  # interleaved so machine noise hits both
        if sync is not None:
            sync()
        t0 = time.perf_counter_ns()
        tap.report(i, **arrays)
        t1 = time.perf_counter_ns()
        q.put(arrays)
        t2 = time.perf_counter_ns()
        report_us.append((t1 - t0) / 1e3)
        put_us.append((t2 - t1) / 1e3)
        if pace_ms:
            time.sleep(pace_ms / 1e3)  # the rest of a training step (GPU work, GIL released)
    t = time.perf_counter()
    tap.flush(600)
    drain = time.perf_counter() - t
    st = tap.stats()
    tap.close()
    r50, r99, p50, p99 = (_pct(report_us, 0.5), _pct(report_us, 0.99),
                          _pct(put_us, 0.5), _pct(put_us, 0.99))  # fmt: skip
    mode = "paced" if pace_ms else "burst"
    print(
        f"{kind:6s} {n:6d} tok {mode} report p50 {r50:8.1f} µs p99 {r99:8.1f} µs | "
        f"queue.put p50 {p50:5.2f} µs p99 {p99:5.2f} µs | ratio p50 {r50 / p50:6.0f}x | "
        f"sent {st['sent']}/{calls} dropped {st['dropped']} (drain {drain:.1f} s)"
    )
    return {
        "inputs": kind,
        "tokens": n,
        "calls": mode,
        "report p50, µs": r50,
        "report p99, µs": r99,
        "queue.put p50, µs": p50,
        "sent": st["sent"],
        "dropped": st["dropped"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument(
        "--pace-ms", type=float, default=20.0,
        help="gap between paced calls (a training step); burst mode calls back to back",
    )  # fmt: skip
    bench_json.add_argument(ap)
    args = ap.parse_args()
    kinds = ["numpy", "torch"]
    rows: list[dict[str, Any]] = []
    try:
        import torch

        if torch.cuda.is_available():
            kinds.append("cuda")
    except ImportError:
        kinds = ["numpy"]
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _server(f"sqlite:///{tmp}/bench.db")
        try:
            for n in (int(x) for x in args.tokens.split(",")):
                for kind in kinds:
                    for pace in (args.pace_ms, 0.0):
                        rows.append(_measure(url, kind, n, args.calls, pace))
        finally:
            proc.terminate()
            proc.wait(10)
    bench_json.write(
        args.json, "tap_overhead",
        {f"{r['inputs']}, {r['tokens']:,} tokens, paced: report p50, µs": r["report p50, µs"]
         for r in rows if r["calls"] == "paced"},
        {}, rows, note=f"{args.calls} calls per row; paced: {args.pace_ms:g} ms between calls",
    )  # fmt: skip


if __name__ == "__main__":
    main()
