"""Latency the SGLang sidecar proxy adds: client → proxy → stand-in SGLang vs client → stand-in.

Both paths run in the same process pair and the same run, interleaved request by request, so
machine noise hits both equally. Prints p50/p95 per path, the ratio and the added milliseconds.

    python benchmarks/proxy_overhead.py [--requests 300] [--tokens 64] [--topk 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(args: list[str], ready: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env)
    for _ in range(1200):  # numba compiles the scanners on a cold cache (~40-60 s here)
        try:
            if httpx.get(ready, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{ready} did not come up")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _time(client: httpx.Client, url: str, body: dict, streamed: bool) -> float:
    t0 = time.perf_counter()
    if streamed:
        with client.stream("POST", url, json=body) as r:
            for _ in r.iter_bytes():
                pass
    else:
        client.post(url, json=body).raise_for_status()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--topk", type=int, default=5)
    bench_json.add_argument(ap)
    args = ap.parse_args()
    out: list[dict[str, object]] = []

    fport, pport = _port(), _port()
    fake = _start(
        ["tests/helpers/fake_sglang.py", "--port", str(fport)], f"http://127.0.0.1:{fport}/health"
    )
    proxy_args = [
        "-c",
        "from timwatch.sidecar.cli import sidecar_app; sidecar_app()",
        "sglang",
        "--upstream",
        f"http://127.0.0.1:{fport}",
        "--listen",
        f"127.0.0.1:{pport}",
        "--topk",
        str(args.topk),
        "--vocab-size",
        "48",
        "--ttl",
        "5",
    ]
    proxy = _start(proxy_args, f"http://127.0.0.1:{pport}/timwatch/healthz")
    try:
        with httpx.Client(timeout=60) as client:
            for streamed in (False, True):
                body = {
                    "text": "benchmark prompt",
                    "stream": streamed,
                    "sampling_params": {"max_new_tokens": args.tokens},
                }
                direct_url = f"http://127.0.0.1:{fport}/generate"
                proxy_url = f"http://127.0.0.1:{pport}/generate"
                for _ in range(20):
                    _time(client, direct_url, body, streamed)
                    _time(client, proxy_url, body, streamed)
                # What the proxy sends upstream: the engine's own extra work, not the proxy's.
                rewritten = dict(body, return_logprob=True, top_logprobs_num=args.topk)
                rewritten["return_prompt_token_ids"] = True
                direct, same, proxied = [], [], []
                for _ in range(args.requests):
                    direct.append(_time(client, direct_url, body, streamed))
                    same.append(_time(client, direct_url, rewritten, streamed))
                    proxied.append(_time(client, proxy_url, body, streamed))
                kind = "stream (cumulative)" if streamed else "non-stream"
                print(f"{kind}: {args.requests} requests x {args.tokens} tokens, topk={args.topk}")
                rows = (
                    ("direct, client's request ", direct),
                    ("direct, proxy's rewrite  ", same),
                    ("through the proxy        ", proxied),
                )
                for name, xs in rows:
                    print(f"  {name} p50 {_pct(xs, 0.5):7.2f} ms  p95 {_pct(xs, 0.95):7.2f} ms")
                print(
                    f"  engine extra work (rewrite vs plain) p50 "
                    f"{statistics.median(same) - statistics.median(direct):+.2f} ms"
                )
                d50, p50 = statistics.median(same), statistics.median(proxied)
                d95, p95 = _pct(same, 0.95), _pct(proxied, 0.95)
                print(
                    f"  proxy vs its rewrite direct: ratio p50 {p50 / d50:.2f}x  "
                    f"added p50 {p50 - d50:+.2f} ms  added p95 {p95 - d95:+.2f} ms"
                )
                out.append({
                    "answer": f"{args.tokens} tokens, {kind}",
                    "direct, rewritten request, p50 ms": d50,
                    "through the proxy, p50 ms": p50,
                    "added p50, ms": p50 - d50,
                    "added p95, ms": p95 - d95,
                })  # fmt: skip
    finally:
        for proc in (proxy, fake):
            proc.terminate()
            proc.wait(timeout=10)
    bench_json.write(
        args.json, "proxy_overhead",
        {f"{r['answer']}: added p50, ms": r["added p50, ms"] for r in out}, {}, out,
        note=f"{args.requests} requests per row against tests/helpers/fake_sglang.py, "
        f"topk {args.topk}",
    )  # fmt: skip


if __name__ == "__main__":
    main()
