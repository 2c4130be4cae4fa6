"""SGLang proxy throughput: one proxy core in front of a fast stand-in engine, vs direct calls.

The stand-in (`benchmarks/sglang_standin.py`) and this process's load generator share core 0;
the proxy runs alone on core 1 (``taskset``). Each scenario is measured direct (client →
engine) and through the proxy (client → proxy → engine) back to back in the same run, and the
ratio is printed; captured tokens/s is the proxy's ``captured`` counter over the window, "busy"
the share of its core the proxy used (from /proc), "waited" the share of the window it was
ready to run but waited for its core (the kernel's run-queue delay, /proc/<pid>/schedstat: on
a shared machine, other processes on the proxy's core), and "per core" captured tokens per
proxy CPU-second: what one fully loaded proxy core would capture; "cpu/req" the proxy's CPU
time per request answered (user + system, deferred captures included); "KB/req" the mean
answer body a client received through the proxy, and "MB/core-s" those body bytes per proxy
CPU-second (what the proxy receives, reads and relays: a stream carries ~10× a plain
answer's bytes for the same tokens).

At concurrency 1 with the instant stand-in, a deferred capture runs while the next request is
at the engine, which answers in ~0.2 ms: the capture's CPU is then in the next request's
latency, so that row's "+p50" is close to "cpu/req". The ``paced`` rows (the engine takes
``--decode-ms``, as decoding does) show the latency the proxy adds when the capture runs while
the engine works. The ``decoding`` row has the stand-in write an incremental stream one frame
per ``--step-ms`` (one chunk, one write), as an engine decoding does, so the proxy reads about
one frame per read and what a read costs decides it, not the bytes; the stand-in and the load
generator pay Python per frame too, so that row's requests/s and p50 are bound by core 0 and
its "cpu/req" is the figure to read. The ``per-token`` row is a 4,096-token incremental stream
written one frame (one chunk, one write) per token with no wait between frames, as an engine
decoding as fast as it can writes it (the stand-in's ``--frames``); ``per-token-floor`` is the
same stream through a proxy whose stream capture is a sink that drops what it is fed: the
frames passed on, not read, the floor under the row above. The ``incremental`` row's streams
arrive in 256 kB pieces, so it is a lower bound on what a stream costs.

The load generator is plain asyncio + httptools: N keep-alive connections, each sending the
next request as soon as its answer has been read in full.

``--no-stream-capture`` relays streams without reading them (the proxy's stream capture
replaced by a sink that drops what it is fed): the relay's own cost per stream. The proxy reads
streams with its C reader where that was built; ``TIMWATCH_NATIVE=0`` in the environment runs
it on the orjson fallback instead (the header line says which).

    python benchmarks/proxy_throughput.py [--seconds 5] [--quick] [--client logprobs|plain]
        [--only per-token,per-token-floor] [--json benchmarks/results/proxy_throughput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httptools
import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _reader() -> str:
    """Which stream reader the proxy (started with this environment) runs."""
    from timwatch.sidecar.proxy import native

    if os.environ.get("TIMWATCH_NATIVE") == "0":
        return "orjson fallback (TIMWATCH_NATIVE=0)"
    return "C" if native.built() else "orjson fallback (the C reader is not built)"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _waited_s(pid: int) -> float:
    """Seconds the process's threads have waited, ready to run, for a CPU so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def _start(stack: ExitStack, core: int, args: list[str], ready: str) -> int:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    cmd = ["taskset", "-c", str(core), sys.executable, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    stack.callback(proc.wait, 10)
    stack.callback(proc.terminate)
    for _ in range(1200):  # numba compiles the scanners on a cold cache (~40-60 s here)
        try:
            if httpx.get(ready, timeout=1).status_code == 200:
                return proc.pid
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{ready} did not come up")


class _Resp:
    def __init__(self) -> None:
        self.done = False
        self.nbytes = 0

    def on_body(self, body: bytes) -> None:
        self.nbytes += len(body)

    def on_message_complete(self) -> None:
        self.done = True


# ``--no-stream-capture``: the proxy's stream capture replaced, before it starts, by a sink that
# drops what it is fed; what relaying a stream costs without reading it (plain answers are
# still captured).
_NO_STREAM_CAPTURE = """
import timwatch.sidecar.proxy.sglang.app as s
class Off:
    def __call__(self, body): pass
    def close(self): pass
s.stream_capture = lambda cap, plan: Off()
"""


def _start_pair(
    stack: ExitStack,
    engine: str,
    engine_args: list[str],
    proxy_args: list[str],
    prelude: str = "",
) -> tuple[int, int, int]:
    """Start ``benchmarks/<engine>_standin.py`` on core 0 and ``timwatch sidecar <engine>``
    in front of it on core 1 (after running ``prelude`` in it); return (engine port, proxy
    port, proxy pid)."""
    e, p = _port(), _port()
    _start(
        stack,
        0,
        [f"benchmarks/{engine}_standin.py", "--port", str(e), *engine_args],
        f"http://127.0.0.1:{e}/health",
    )
    proxy = [
        "-c",
        prelude + "\nfrom timwatch.sidecar.cli import sidecar_app; sidecar_app()",
        engine,
        "--upstream",
        f"http://127.0.0.1:{e}",
        "--listen",
        f"127.0.0.1:{p}",
        "--ttl",
        "30",
        *proxy_args,
    ]
    return e, p, _start(stack, 1, proxy, f"http://127.0.0.1:{p}/timwatch/healthz")


# Answers read in full so far (warm-up included), for `--no-stream-capture`'s "cpu/req".
_COMPLETED = [0]


async def _conn(
    port: int, request: bytes, until: float, lat: list[float], warm: float, sizes: list[int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            writer.write(request)
            resp = _Resp()
            parser = httptools.HttpResponseParser(resp)
            while not resp.done:
                data = await reader.read(1 << 20)
                if not data:
                    raise ConnectionError("closed")
                parser.feed_data(data)
            if parser.get_status_code() != 200:
                raise RuntimeError(f"status {parser.get_status_code()}")
            _COMPLETED[0] += 1
            if t0 >= warm:
                lat.append(time.perf_counter() - t0)
                sizes.append(resp.nbytes)
    finally:
        writer.close()


def _load(
    port: int, body: dict, conc: int, seconds: float, path: str = "/generate"
) -> tuple[float, float, float]:
    """(requests/s, p50 latency ms, mean body bytes per answer) with ``conc`` connections for
    ``seconds`` after 1 s warmup."""
    payload = orjson.dumps(body)
    request = (
        b"POST %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n" % path.encode()
        + b"content-length: %d\r\n\r\n" % len(payload)
        + payload
    )
    lat: list[float] = []
    sizes: list[int] = []

    async def run() -> None:
        now = time.perf_counter()
        warm, until = now + 1.0, now + 1.0 + seconds
        await asyncio.gather(*(_conn(port, request, until, lat, warm, sizes) for _ in range(conc)))

    t0 = time.perf_counter()
    asyncio.run(run())
    window = time.perf_counter() - t0 - 1.0
    p50 = 1e3 * statistics.median(lat) if lat else float("nan")
    return len(lat) / window, p50, statistics.fmean(sizes) if sizes else 0.0


def _captured(port: int) -> int:
    return int(
        httpx.get(f"http://127.0.0.1:{port}/timwatch/counters").json()["capture"]["captured"]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--client", choices=["logprobs", "plain"], default="logprobs")
    ap.add_argument("--quick", action="store_true", help="only the 4,096-token rows")
    ap.add_argument("--topk", type=int, default=0, help="proxy --topk (0: off)")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated modes to run (plain,paced,incremental,decoding,per-token,"
        "per-token-floor,cumulative)",
    )
    ap.add_argument(
        "--decode-ms",
        type=float,
        default=50.0,
        help="the paced engine's time per answer (the 'paced' rows: added latency when the "
        "engine takes the time a real one does, so deferred captures run while it decodes)",
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        default=2.0,
        help="the decoding engine's time per token (the 'decoding' row: an incremental stream "
        "written one frame per decode step, so the proxy gets about one frame per read)",
    )
    ap.add_argument(
        "--no-stream-capture",
        action="store_true",
        help="streams relayed but not read (the capture's sink drops them): the relay's own "
        "cost; captured/s then counts plain answers only",
    )
    bench_json.add_argument(ap)
    args = ap.parse_args()
    os.sched_setaffinity(0, {0})
    scenarios = [
        ("plain", 4096, 64),
        ("plain", 4096, 1),
        ("plain", 4096, 16),
        ("plain", 4096, 256),
        ("plain", 256, 64),
        ("plain", 64, 1),
        ("paced", 4096, 1),
        ("paced", 64, 1),
        ("incremental", 4096, 64),
        ("decoding", 512, 64),
        ("per-token", 4096, 64),
        ("per-token-floor", 4096, 64),
        ("cumulative", 4096, 1),
        ("cumulative", 4096, 4),
    ]
    if args.quick:
        scenarios = [s for s in scenarios if s[2] == 1 or (s[1] == 4096 and s[2] == 64)]
    if args.only:
        scenarios = [s for s in scenarios if s[0] in args.only.split(",")]
    with ExitStack() as stack:
        ports: dict[str, tuple[int, int, int]] = {}
        topk = ["--topk", str(args.topk)] if args.topk else []
        wanted = {s[0] for s in scenarios}
        modes = ("cumulative", "incremental", "decoding", "per-token", "per-token-floor", "paced")
        for mode in modes:
            if mode != "cumulative" and mode not in wanted:
                continue
            extra = {
                "cumulative": [],
                "incremental": ["--incremental-streaming-output"],
                "decoding": ["--incremental-streaming-output", "--step-ms", str(args.step_ms)],
                "per-token": ["--incremental-streaming-output", "--frames"],
                "per-token-floor": ["--incremental-streaming-output", "--frames"],
                "paced": ["--decode-ms", str(args.decode_ms)],
            }[mode]
            floor = args.no_stream_capture or mode == "per-token-floor"
            prelude = _NO_STREAM_CAPTURE if floor else ""
            ports[mode] = _start_pair(stack, "sglang", extra, topk, prelude)
        print(
            f"load average at the start: {os.getloadavg()[0]:.1f}; "
            f"client: {args.client}; proxy topk: {args.topk or 'off'}; {args.seconds:.0f} s "
            "per cell; engine + load generator on core 0, proxy on core 1; stream reader: "
            + _reader()
            + (
                "; --no-stream-capture: streams relayed, not read ('captured' counts the "
                "tokens they relayed)"
                if args.no_stream_capture
                else ""
            )
        )
        print(
            f"{'answer':<40}{'conc':>5}{'direct r/s':>12}{'proxy r/s':>11}{'ratio':>7}"
            f"{'+p50 ms':>9}{'captured/s':>11}{'busy':>7}{'waited':>7}{'per core':>9}"
            f"{'cpu/req':>9}{'KB/req':>9}{'MB/core-s':>10}"
        )
        per_core: dict[tuple[str, int, int], float] = {}
        bytes_core: dict[tuple[str, int, int], float] = {}
        cpu_req: dict[tuple[str, int, int], float] = {}
        rows: list[dict[str, object]] = []
        for mode, tokens, conc in scenarios:
            engine, proxy, pid = ports[mode if mode != "plain" else "cumulative"]
            body: dict = {
                "input_ids": list(range(16)),
                "sampling_params": {"max_new_tokens": tokens},
                "stream": mode not in ("plain", "paced"),
            }
            if args.client == "logprobs":
                body["return_logprob"] = True
            # a cumulative 4,096-token stream is ~360 MB of JSON: give streams a longer window
            seconds = args.seconds * {
                "cumulative": 6, "incremental": 2, "decoding": 2, "per-token": 4,
                "per-token-floor": 4,
            }.get(mode, 1)  # fmt: skip
            d_rps, d_p50, _ = _load(engine, body, conc, seconds)
            before, cpu0, wait0 = _captured(proxy), _cpu_s(pid), _waited_s(pid)
            completed = _COMPLETED[0]
            t0 = time.perf_counter()
            p_rps, p_p50, size = _load(proxy, body, conc, seconds)
            took = time.perf_counter() - t0
            answered = _captured(proxy) - before
            if (args.no_stream_capture and body["stream"]) or mode == "per-token-floor":
                answered = _COMPLETED[0] - completed  # relayed, not captured
            captured, cpu = answered * tokens, _cpu_s(pid) - cpu0
            tok_s, busy = captured / took, cpu / took
            waited = (_waited_s(pid) - wait0) / took
            label = f"{tokens} tokens, " + {
                "plain": "not streamed",
                "paced": f"not streamed, engine {args.decode_ms:.0f} ms",
                "decoding": f"incremental, {args.step_ms:g} ms a token",
                "per-token": "incremental, a frame per token",
                "per-token-floor": "a frame per token, relayed only",
            }.get(mode, f"{mode} stream")
            ratio = p_rps / d_rps if d_rps else float("nan")
            per_core[(mode, tokens, conc)] = tok_s / max(busy, 1e-9)
            # the body bytes the proxy received, read and relayed per CPU-second
            bytes_core[(mode, tokens, conc)] = answered * size / max(cpu, 1e-9)
            cpu_req[(mode, tokens, conc)] = 1e3 * cpu / max(answered, 1)
            rows.append(
                {
                    "answer": label,
                    "conc.": conc,
                    "direct, req/s": d_rps,
                    "proxy, req/s": p_rps,
                    "added p50, ms": p_p50 - d_p50,
                    "proxy busy": busy,
                    "waited": waited,
                    "per proxy core, tokens/s": per_core[(mode, tokens, conc)],
                    "cpu/req, ms": cpu_req[(mode, tokens, conc)],
                    "KB/req": size / 1e3,
                }
            )
            print(
                f"{label:<40}{conc:>5}{d_rps:>12.1f}{p_rps:>11.1f}{ratio:>7.2f}"
                f"{p_p50 - d_p50:>+9.2f}{tok_s / 1e6:>10.2f}M{busy:>7.0%}{waited:>7.0%}"
                f"{per_core[(mode, tokens, conc)] / 1e6:>8.2f}M"
                f"{1e3 * cpu / max(answered, 1):>7.2f}ms{size / 1e3:>9.0f}"
                f"{bytes_core[(mode, tokens, conc)] / 1e6:>10.0f}",
                flush=True,
            )
        plain = per_core.get(("plain", 4096, 64))
        streams = ("incremental", "decoding", "per-token", "per-token-floor", "cumulative")
        ratios: dict[str, float] = {}
        for (mode, _tokens, _conc), value in per_core.items():
            if mode in streams and plain:
                ratios[f"{mode} per proxy core / plain per proxy core"] = value / plain
                in_bytes = bytes_core[(mode, _tokens, _conc)] / bytes_core[("plain", 4096, 64)]
                print(
                    f"{mode} stream per proxy core / plain per proxy core: {value / plain:.2f} "
                    f"in tokens, {in_bytes:.2f} in body bytes"
                )
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
        figures: dict[str, object] = {"stream reader": _reader()}
        for key, name in (
            (("per-token", 4096, 64), "a frame per token, 4,096 tokens: proxy CPU per stream, ms"),
            (("per-token-floor", 4096, 64), "the same, relayed and not read (floor), ms"),
            (("incremental", 4096, 64), "4,096 tokens in 256 kB pieces (lower bound), ms"),
            (("plain", 4096, 64), "4,096 tokens not streamed, 64 concurrent: ms per answer"),
            (("plain", 4096, 1), "4,096 tokens not streamed, concurrency 1: ms per answer"),
        ):
            if key in cpu_req:
                figures[name] = cpu_req[key]
        if ("per-token", 4096, 64) in cpu_req and ("per-token-floor", 4096, 64) in cpu_req:
            ratios["a frame per token: captured / relayed only"] = (
                cpu_req[("per-token", 4096, 64)] / cpu_req[("per-token-floor", 4096, 64)]
            )
        if ("per-token", 4096, 64) in cpu_req and ("incremental", 4096, 64) in cpu_req:
            ratios["a frame per token / in 256 kB pieces"] = (
                cpu_req[("per-token", 4096, 64)] / cpu_req[("incremental", 4096, 64)]
            )
        bench_json.write(args.json, "proxy_throughput", figures, ratios, rows)


if __name__ == "__main__":
    main()
