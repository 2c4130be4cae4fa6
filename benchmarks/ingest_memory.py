"""Peak memory and parse speed of a JSON batch ingest: the array scanner against orjson.

    python benchmarks/ingest_memory.py [--mb 64] [--concurrent 1,4]

Each measurement runs in a fresh subprocess that imports everything, warms the kernel up on a
tiny batch, reads its RSS, loads C bodies of about MB megabytes each and ingests them from C
threads at once, then reads its peak RSS (VmHWM). Printed: the peak growth over the body bytes
(the body itself counts: 1.0 means no memory beyond the bodies), for

- ``new``: `ingest_batch` on SQLite (scanner + validation + kernel + store), as the server runs it;
- ``new-parse``: ``Batch.from_json_bytes`` alone;
- ``old-parse``: ``Batch.from_json(orjson.loads(body))``, the parse ingest used before;
- ``server``: a real ``timwatch serve`` (SQLite) receiving the bodies over HTTP, its peak RSS
  read from ``/proc/PID/status`` (this includes the request body being assembled).

Then the parse time of one body, scanner against orjson (ratio < 1: the scanner is faster).
Bounded: 64 MB × 4 bodies keep the old path near 2.5 GB of RSS; pass a smaller --mb on a small
machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_json  # noqa: E402


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def make_body(path: Path, mb: float) -> None:
    """A valid batch of about `mb` MB of JSON (four float fields, mask, token ids)."""
    n = int(mb * 1e6 / 72)  # ~72 bytes of JSON per token across the fields
    rng = np.random.default_rng(0)
    mu = -rng.exponential(1.0, n)
    obj = {
        "step": 1,
        "cu_seqlens": list(range(0, n, 1000)) + [n],
        "logp_rollout": mu.tolist(),
        "logp_train": (mu - rng.exponential(0.01, n)).tolist(),
        "entropy": rng.exponential(1.0, n).tolist(),
        "loss_mask": np.ones(n, dtype=np.int64).tolist(),
        "token_ids": rng.integers(0, 150_000, n).tolist(),
    }
    path.write_text(json.dumps(obj))


def child(mode: str, body_path: str, copies: int) -> None:
    import orjson

    from timwatch.monitor.core.batch import Batch
    from timwatch.monitor.core.masks import PolicyParams
    from timwatch.monitor.service.ingest import ingest_batch
    from timwatch.monitor.service.runs import RunRegistry
    from timwatch.monitor.store import Store

    tiny = json.dumps(
        {"cu_seqlens": [0, 2], "logp_rollout": [-1.0, -2.0], "logp_train": [-1.0, -2.0],
         "entropy": [1.0, 1.0], "loss_mask": [1, 1]}
    ).encode()  # fmt: skip
    tmp = tempfile.mkdtemp()
    store = Store(f"sqlite:///{tmp}/m.db")
    runs = RunRegistry()

    def run(body: bytes, i: int) -> None:
        if mode == "new":
            ingest_batch(store, runs, f"r{i}", body, "application/json", params=PolicyParams())
        elif mode == "new-parse":
            Batch.from_json_bytes(body)
        else:
            Batch.from_json(orjson.loads(body))

    run(tiny, 99)
    base = _status("VmRSS")
    bodies = [Path(body_path).read_bytes() for _ in range(copies)]
    threads = [threading.Thread(target=run, args=(b, i)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    size = sum(len(b) for b in bodies)
    print(json.dumps({"ratio": (_status("VmHWM") - base) / size, "base": base, "size": size}))


def server_ratio(body_path: str, copies: int) -> float:
    import httpx

    from tests.helpers.procs import ServerProc, free_port, server_env

    body = Path(body_path).read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProc(
            db=f"sqlite:///{tmp}/s.db", port=free_port(),
            args=["--max-body", str(2 * len(body))], env=server_env(None), log=Path(tmp) / "log",
        )  # fmt: skip
        srv.start()
        try:
            assert srv.proc is not None
            status = Path(f"/proc/{srv.proc.pid}/status")

            def read(key: str) -> int:
                for line in status.read_text().splitlines():
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
                raise KeyError(key)

            tiny = json.dumps(
                {"cu_seqlens": [0, 2], "logp_rollout": [-1.0, -2.0], "logp_train": [-1.0, -2.0],
                 "entropy": [1.0, 1.0], "loss_mask": [1, 1]}
            ).encode()  # fmt: skip
            with httpx.Client(base_url=srv.url, timeout=600) as c:
                assert c.post("/v1/runs/warm/batches", content=tiny).status_code == 200
            base = read("VmRSS")

            def post(i: int) -> None:
                with httpx.Client(base_url=srv.url, timeout=600) as c:
                    r = c.post(f"/v1/runs/s{i}/batches", content=body)
                    assert r.status_code == 200, r.text[:200]

            threads = [threading.Thread(target=post, args=(i,)) for i in range(copies)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return (read("VmHWM") - base) / (len(body) * copies)
        finally:
            srv.stop()


def parse_times(body_path: str, repeats: int = 3) -> tuple[float, float]:
    import orjson

    from timwatch.monitor.core.jsonscan import scan_batch

    body = Path(body_path).read_bytes()
    fields = ("logp_rollout", "logp_train", "entropy", "loss_mask", "token_ids", "cu_seqlens")

    def old() -> None:
        obj = orjson.loads(body)
        for k in fields:
            np.asarray(obj[k])

    best_new = best_old = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        scan_batch(body)
        best_new = min(best_new, time.perf_counter() - t)
        t = time.perf_counter()
        old()
        best_old = min(best_old, time.perf_counter() - t)
    return best_new, best_old


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=64.0)
    p.add_argument("--concurrent", default="1,4")
    p.add_argument("--child", nargs=3, metavar=("MODE", "BODY", "COPIES"))
    bench_json.add_argument(p)
    args = p.parse_args()
    rows: list[dict[str, object]] = []
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body.json"
        make_body(body, args.mb)
        mb = body.stat().st_size / 1e6
        print(f"body: {mb:.1f} MB of JSON")
        print(f"{'mode':<10} {'bodies':>6} {'peak RSS growth / body bytes':>30}")
        for copies in (int(c) for c in args.concurrent.split(",")):
            for mode in ("new", "new-parse", "old-parse"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", mode, str(body), str(copies)],
                    capture_output=True, text=True, check=True, cwd=REPO,
                )  # fmt: skip
                ratio = json.loads(out.stdout.strip().splitlines()[-1])["ratio"]
                print(f"{mode:<10} {copies:>6} {ratio:>30.2f}")
                rows.append(
                    {"mode": mode, "bodies at once": copies, "peak RSS / body bytes": ratio}
                )
            served = server_ratio(str(body), copies)
            print(f"{'server':<10} {copies:>6} {served:>30.2f}")
            rows.append(
                {"mode": "server", "bodies at once": copies, "peak RSS / body bytes": served}
            )
        new, old = parse_times(str(body))
        print(f"parse of one body: scanner {new:.3f} s, orjson + numpy {old:.3f} s, "
              f"ratio {new / old:.2f}")  # fmt: skip
    bench_json.write(
        args.json, "ingest_memory",
        {f"server, {r['bodies at once']} body(ies): peak RSS growth per body byte":
         r["peak RSS / body bytes"] for r in rows if r["mode"] == "server"},
        {"scanner parse time / orjson + numpy parse time": new / old}, rows,
        note=f"{mb:.1f} MB JSON bodies",
    )  # fmt: skip


if __name__ == "__main__":
    main()
