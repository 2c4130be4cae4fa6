"""What `Tap.report()` costs a trainer for a 1M-token batch while the monitor is down.

The tap points at a closed loopback port, so its shipper thread keeps failing, backing off and
dropping the oldest batches while the calls are timed; whatever it does with the GIL is part of
the measurement. For numpy float32 arrays and for CPU torch tensors (bf16 trainer log-probs,
bool mask) it interleaves ``--calls`` `report()` calls with a plain copy of the same arrays
(``np.copy`` of each, on the same bytes for the tensors) and prints p50/p99/max of both and
their ratio, plus the tap's counters, then the calling thread's CPU time for both (what the
call itself costs, without the time spent waiting for a core or the GIL on a loaded host).
The tap retries fast (2 retries, 50-200 ms backoff), so its shipper keeps validating, hashing
and failing to connect while the calls are timed. Bounded: about 10 s with the defaults.

    python benchmarks/tap_report.py [--calls 200] [--tokens 1000000] [--pace-ms 0]
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_json  # noqa: E402
from benchmarks.tap_overhead import payload as trainer_payload  # noqa: E402
from timwatch.sidecar.tap import Tap  # noqa: E402


def _closed_port() -> int:
    with socket.socket() as s:  # bound then closed: nobody listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plain_copy(payload: dict[str, Any]) -> list[np.ndarray]:
    out = []
    for v in payload.values():
        if hasattr(v, "numpy"):  # a tensor: copy its own bytes (numpy has no bfloat16)
            import torch

            v = (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy()
        out.append(np.copy(v))
    return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs), q))


def _measure(url: str, kind: str, n: int, calls: int, pace_ms: float) -> dict[str, Any]:
    payload = trainer_payload(n, kind, seq_len=1024)
    tap = Tap(url, f"bench-{kind}", rank=0, max_retries=2, backoff_s=0.05, max_backoff_s=0.2)
    for i in range(3):  # warm the allocator and the shipper before timing
        tap.report(i, **payload)
        _plain_copy(payload)
    rep, cp, rep_cpu, cp_cpu, filling = [], [], [], [], []
    for i in range(calls):  # interleaved so machine noise hits both
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        tap.report(i, **payload)
        c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
        filling.append(tap.stats()["dropped"] == 0)  # the queue still grows into new memory
        kept = _plain_copy(payload)
        c2, t2 = time.thread_time_ns(), time.perf_counter_ns()
        del kept
        rep.append((t1 - t0) / 1e6)
        cp.append((t2 - t1) / 1e6)
        rep_cpu.append((c1 - c0) / 1e6)
        cp_cpu.append((c2 - c1) / 1e6)
        if pace_ms:
            time.sleep(pace_ms / 1e3)
    st = tap.stats()
    tap.close(0.5)
    full = [r for r, f in zip(rep, filling, strict=True) if not f]
    grow = [r for r, f in zip(rep, filling, strict=True) if f]
    r50, r99, rmax = _pct(rep, 0.5), _pct(rep, 0.99), max(rep)
    c50, c99, cmax = _pct(cp, 0.5), _pct(cp, 0.99), max(cp)
    mib = sum(c.nbytes for c in _plain_copy(payload)) / 2**20
    print(
        f"{kind:5s} {n} tok ({mib:.0f} MiB) report p50 {r50:6.2f} p99 {r99:6.2f} max {rmax:6.2f} ms"
        f" | np.copy p50 {c50:6.2f} p99 {c99:6.2f} max {cmax:6.2f} ms"
        f" | ratio p50 {r50 / c50:4.2f}x p99 {r99 / c99:4.2f}x"
        f" | dropped {st['dropped']} failed {st['failed']} queue {st['queue']}"
        f" queue_bytes {st.get('queue_bytes', '-')}"
    )
    print(
        f"{'':5s} this thread's CPU time: report p50 {_pct(rep_cpu, 0.5):6.2f} p99"
        f" {_pct(rep_cpu, 0.99):6.2f} ms | np.copy p50 {_pct(cp_cpu, 0.5):6.2f} p99"
        f" {_pct(cp_cpu, 0.99):6.2f} ms (excludes waiting for the GIL or a busy core)"
    )
    if grow and full:
        print(
            f"{'':5s} while the queue fills ({len(grow)} calls: fresh memory, a page fault per"
            f" 4 KiB) p50 {_pct(grow, 0.5):6.2f} max {max(grow):6.2f} ms | once it is full"
            f" ({len(full)} calls: buffers reused) p50 {_pct(full, 0.5):6.2f} p99"
            f" {_pct(full, 0.99):6.2f} max {max(full):6.2f} ms"
        )
    return {
        "inputs": kind,
        "tokens": n,
        "MiB": mib,
        "report p50, ms": r50,
        "report p99, ms": r99,
        "queue full: report p99, ms": _pct(full, 0.99) if full else "-",
        "np.copy p50, ms": c50,
        "report p50 / np.copy p50": r50 / c50,
        "dropped": st["dropped"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--pace-ms", type=float, default=0.0, help="sleep between calls (a step)")
    bench_json.add_argument(ap)
    args = ap.parse_args()
    kinds = ["numpy"]
    try:
        import torch  # noqa: F401

        kinds.append("torch")
    except ImportError:
        print("torch not installed: numpy inputs only")
    url = f"http://127.0.0.1:{_closed_port()}"
    started = time.perf_counter()
    rows = [_measure(url, kind, args.tokens, args.calls, args.pace_ms) for kind in kinds]
    print(f"total {time.perf_counter() - started:.1f} s")
    bench_json.write(
        args.json, "tap_report",
        {f"{r['inputs']}: report p99 once the queue is full, ms": r["queue full: report p99, ms"]
         for r in rows},
        {f"{r['inputs']}: report p50 / np.copy p50": r["report p50 / np.copy p50"] for r in rows},
        rows, note=f"{args.calls} calls per input kind, the monitor down",
    )  # fmt: skip


if __name__ == "__main__":
    main()
