"""SGLang proxies behind HAProxy: captured tokens/s with 1 vs N proxies, and the report fan-out.

Everything runs for real on this machine: the fast stand-in (`benchmarks/sglang_standin.py`;
SGLang needs a GPU), N ``timwatch sidecar sglang`` processes with ``--peer`` for each other,
HAProxy with the committed ``deploy/sglang-proxies/haproxy.cfg`` (addresses replaced) and a
``timwatch serve`` on SQLite as the monitor. Nothing is pinned: on a machine with fewer cores
than processes the figures say how the processes share them, so the load average is printed.

1. Capture: a keep-alive load generator (asyncio + httptools, ``--conc`` connections through
   HAProxy, 4,096-token non-streamed answers with log-probs) for ``--seconds``; captured tokens/s
   is the sum of the proxies' ``captured`` counters over the window; the first row is one proxy
   called directly (no HAProxy), the baseline of the ratio column.
2. Report fan-out: ``--samples`` answers of ``--report-tokens`` tokens generated through
   HAProxy, then trainer reports of ``--report-size`` samples posted through HAProxy; each
   report's latency (ms, median over reports) with N proxies (a share (N-1)/N of each report
   taken from the peers) against one proxy holding everything.

    python benchmarks/proxy_scaleout.py [--proxies 2] [--seconds 5] [--conc 64]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_json  # noqa: E402
from proxy_throughput import _load, _port  # noqa: E402  (the same keep-alive load generator)

ROOT = Path(__file__).resolve().parent.parent
CFG = ROOT / "deploy" / "sglang-proxies" / "haproxy.cfg"


def _start(stack: ExitStack, args: list[str], ready: str | None) -> subprocess.Popen[bytes]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    stack.callback(proc.wait, 10)
    stack.callback(proc.terminate)
    for _ in range(1200):  # numba compiles the scanners on a cold cache (~40-60 s here)
        if ready is None:
            return proc
        try:
            if httpx.get(ready, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{ready} did not come up")


def _haproxy(stack: ExitStack, tmp: Path, listen: int, servers: list[int]) -> None:
    text = CFG.read_text()
    text = re.sub(r"^    bind \S+$", f"    bind 127.0.0.1:{listen}", text, flags=re.M)
    text = re.sub(r"^    server .*\n", "", text, flags=re.M)
    text += "".join(f"    server proxy-{i} 127.0.0.1:{p}\n" for i, p in enumerate(servers))
    cfg = tmp / f"haproxy-{listen}.cfg"
    cfg.write_text(text)
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    _start(stack, [binary, "-db", "-f", str(cfg)], None)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # every server up: as many distinct answers as servers
        seen = set()
        for _ in range(2 * len(servers)):
            try:
                r = httpx.get(f"http://127.0.0.1:{listen}/timwatch/healthz", timeout=1)
                seen.add(r.headers.get("x-timwatch-proxy"))
            except httpx.HTTPError:
                pass
        if len(seen - {None}) == len(servers):
            return
        time.sleep(0.2)
    raise RuntimeError("haproxy never saw every proxy up")


def _proxies(stack: ExitStack, n: int, engine: str, monitor: str) -> list[int]:
    ports = [_port() for _ in range(n)]
    peers = [a for p in ports for a in ("--peer", f"http://127.0.0.1:{p}")] if n > 1 else []
    for p in ports:
        cmd = [sys.executable, "-m", "timwatch", "sidecar", "sglang", "--upstream", engine,
               "--listen", f"127.0.0.1:{p}", "--monitor", monitor, "--run", "bench",
               "--ttl", "60", *peers]  # fmt: skip
        _start(stack, cmd, f"http://127.0.0.1:{p}/timwatch/healthz")
    return ports


def _captured(ports: list[int]) -> int:
    return sum(
        int(httpx.get(f"http://127.0.0.1:{p}/timwatch/counters").json()["capture"]["captured"])
        for p in ports
    )


def _capture_rate(front: int, ports: list[int], tokens: int, conc: int, seconds: float) -> float:
    body = {"input_ids": list(range(16)), "return_logprob": True,
            "sampling_params": {"max_new_tokens": tokens}}  # fmt: skip
    _load(front, body, conc, 0.5)  # warm-up (1.5 s: _load warms up for 1 s itself)
    before, t0 = _captured(ports), time.perf_counter()
    _load(front, body, conc, seconds)
    took = time.perf_counter() - t0
    return (_captured(ports) - before) * tokens / took


def _fanout(front: int, samples: int, tokens: int, size: int) -> float:
    """Median ms per trainer report of ``size`` samples, all generated through ``front``."""
    outputs: list[tuple[str, list[int]]] = []
    body = {"input_ids": list(range(16)), "sampling_params": {"max_new_tokens": tokens}}
    for _ in range(samples):  # a new connection each: HAProxy balances each one
        answer = httpx.post(f"http://127.0.0.1:{front}/generate", json=body, timeout=30).json()
        outputs.append((answer["meta_info"]["id"], answer["output_ids"]))
    took = []
    with httpx.Client(timeout=60) as c:
        for at in range(0, samples, size):
            report = {"step": at, "samples": [
                {"rid": rid, "logp_train": [-0.5] * len(ids), "entropy": [1.0] * len(ids)}
                for rid, ids in outputs[at : at + size]
            ]}  # fmt: skip
            t0 = time.perf_counter()
            answer = c.post(f"http://127.0.0.1:{front}/timwatch/v1/trainer_reports", json=report)
            took.append(time.perf_counter() - t0)
            got = answer.json()
            if got.get("status") != "forwarded" or got["joined"] != size:
                raise RuntimeError(f"report not joined whole: {got}")
    return 1e3 * statistics.median(took)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proxies", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--report-size", type=int, default=64)
    ap.add_argument("--report-tokens", type=int, default=1024)
    bench_json.add_argument(ap)
    args = ap.parse_args()
    rows: list[dict[str, object]] = []
    ratios: dict[str, float] = {}
    print(f"{os.cpu_count()} cores; load average before: {os.getloadavg()}")
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        e, m = _port(), _port()
        engine = f"http://127.0.0.1:{e}"
        _start(stack, [sys.executable, "benchmarks/sglang_standin.py", "--port", str(e)],
               f"{engine}/health")  # fmt: skip
        _start(
            stack,
            [sys.executable, "-m", "timwatch", "serve", "--port", str(m), "--db",
             f"sqlite:///{tmp}/bench.db", "--log-level", "warning"],
            f"http://127.0.0.1:{m}/healthz",
        )  # fmt: skip
        monitor = f"http://127.0.0.1:{m}"
        fronts = {}
        for n in sorted({1, args.proxies}):
            ports = _proxies(stack, n, engine, monitor)
            fronts[n] = (_port(), ports)
            _haproxy(stack, Path(tmp), fronts[n][0], ports)
        one = fronts[1][1]
        print(f"capture: {args.tokens}-token plain answers, {args.conc} connections, "
              f"{args.seconds:.0f} s per row")  # fmt: skip
        base = _capture_rate(one[0], one, args.tokens, args.conc, args.seconds)
        print(f"  1 proxy, direct           {base / 1e6:6.2f}M tokens/s  1.00")
        rows.append({"what": "capture, 1 proxy called directly", "tokens/s": base})
        for n, (front, ports) in fronts.items():
            rate = _capture_rate(front, ports, args.tokens, args.conc, args.seconds)
            print(f"  {n} proxies, HAProxy{' ' * 8}{rate / 1e6:6.2f}M tokens/s  {rate / base:.2f}")
            rows.append({"what": f"capture, {n} proxies behind HAProxy", "tokens/s": rate})
            ratios[f"{n} proxies behind HAProxy / 1 proxy direct"] = rate / base
        print(f"report fan-out: {args.samples} samples of {args.report_tokens} tokens, "
              f"reports of {args.report_size} samples through HAProxy")  # fmt: skip
        single = None
        for n, (front, _) in fronts.items():
            ms = _fanout(front, args.samples, args.report_tokens, args.report_size)
            single = single or ms
            print(f"  {n} proxies: {ms:7.1f} ms per report ({1e3 * ms / args.report_size:.0f} µs "
                  f"per sample), {ms / single:.2f}× one proxy")  # fmt: skip
            rows.append({"what": f"report of {args.report_size} samples, {n} proxies", "ms": ms})
            ratios[f"report, {n} proxies / 1 proxy"] = ms / single
    print(f"load average after: {os.getloadavg()}")
    bench_json.write(
        args.json, "proxy_scaleout", {}, ratios, rows,
        note=f"{args.tokens}-token plain answers, {args.conc} connections",
    )  # fmt: skip


if __name__ == "__main__":
    main()
