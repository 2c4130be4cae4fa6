"""The least CPU any proxy on one core can spend passing an answer's bytes on, per answer.

No HTTP, no parsing, no capture: a relay process pinned to core 1 moves the exact wire bytes
of `benchmarks/sglang_standin.py`'s answers (a non-streamed 4,096-token answer, the same
answer as an incremental stream and as a cumulative stream: ``return_logprob``, no top-k)
from one loopback TCP connection to another, while a sender and a receiver on core 0 feed and
drain it. Two relays, each measured in the same run:

* ``copy``: ``recv_into`` a 256 kB buffer, then ``sendall`` it: what a relay that has the
  bytes in its own memory (so it can read them) costs at least, whatever its language;
* ``splice``: the kernel moves the bytes through a pipe (``os.splice``) and the relay never
  sees them: the floor for passing them on at all (Linux only).

Per answer it prints the relay's CPU (user + system, from ``getrusage``), bytes per
CPU-second, tokens per CPU-second (the most captured tokens per core a proxy relaying these
bytes could reach), each stream's ratio to the plain answer on the same relay, and splice's
ratio to copy. The proxy's own figures are `benchmarks/proxy_throughput.py`'s.

    python benchmarks/relay_floor.py [--tokens 4096] [--seconds 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import resource
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_json  # noqa: E402
import sglang_standin as standin  # noqa: E402

_F_SETPIPE_SZ = 1031
_PIPE = 1 << 20


def _pair() -> tuple[socket.socket, socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    return a, b


def _feed_and_drain(out: socket.socket, into: socket.socket, data: bytes, n: int) -> None:
    """Core 0: send ``data`` ``n`` times on ``out`` while draining as many bytes from ``into``."""
    os.sched_setaffinity(0, {0})
    total = len(data) * n

    def drain() -> None:
        buf, got = bytearray(_PIPE), 0
        while got < total:
            got += into.recv_into(buf)

    reader = threading.Thread(target=drain)
    reader.start()
    view = memoryview(data)
    for _ in range(n):
        out.sendall(view)
    reader.join()


def _relay(mode: str, up: socket.socket, down: socket.socket, total: int) -> None:
    if mode == "copy":
        buf = bytearray(256 << 10)
        view = memoryview(buf)
        while total:
            got = up.recv_into(buf)
            down.sendall(view[:got])
            total -= got
        return
    rd, wr = os.pipe()
    try:
        fcntl.fcntl(wr, _F_SETPIPE_SZ, _PIPE)
        src, dst = up.fileno(), down.fileno()
        while total:
            got = os.splice(src, wr, _PIPE)
            total -= got
            while got:
                got -= os.splice(rd, dst, got)
    finally:
        os.close(rd)
        os.close(wr)


def measure(mode: str, data: bytes, n: int) -> float:
    """CPU seconds the relay process spends per copy of ``data`` passed on (``n`` copies)."""
    up_send, up_recv = _pair()
    down_send, down_recv = _pair()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            up_recv.close()
            down_send.close()
            os.read(ready_r, 1)
            _feed_and_drain(up_send, down_recv, data, n)
        finally:
            os._exit(0)
    up_send.close()
    down_recv.close()
    os.sched_setaffinity(0, {1})
    before = resource.getrusage(resource.RUSAGE_SELF)
    os.write(ready_w, b"x")
    _relay(mode, up_recv, down_send, len(data) * n)
    after = resource.getrusage(resource.RUSAGE_SELF)
    down_send.close()
    up_recv.close()
    os.waitpid(pid, 0)
    os.close(ready_r)
    os.close(ready_w)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return cpu / n


def _answers(tokens: int) -> dict[str, bytes]:
    return {
        "plain": standin.answer_bytes(tokens),
        "incremental": standin.stream_bytes(tokens, incremental=True),
        "cumulative": standin.stream_bytes(tokens, incremental=False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=2.0, help="about this long per row")
    ap.add_argument("--repeat", type=int, default=2, help="rows measured this often, interleaved")
    bench_json.add_argument(ap)
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two cores (the relay alone on core 1)")
    answers = _answers(args.tokens)
    print(f"relay floor, {args.tokens}-token answers; relay pinned to core 1, feed on core 0")
    print(f"{'answer':>12}{'MB':>9}{'relay':>8}{'cpu/answer':>12}{'GB/cpu-s':>10}{'tok/cpu-s':>11}")
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.repeat):
        for name, data in answers.items():
            for mode in ("copy", "splice"):
                # a rough count first, so each row takes about --seconds
                probe = measure(mode, data, 2)
                n = max(2, min(5000, int(args.seconds / max(probe, 1e-6))))
                cpu = measure(mode, data, n)
                key = (name, mode)
                best[key] = min(best.get(key, cpu), cpu)
                print(
                    f"{name:>12}{len(data) / 1e6:>9.2f}{mode:>8}{1e3 * cpu:>10.3f}ms"
                    f"{len(data) / cpu / 1e9:>10.2f}{args.tokens / cpu / 1e6:>10.3f}M"
                )
    print("\nbest of the runs; ratios in the same run")
    ratios: dict[str, float] = {}
    for name in ("incremental", "cumulative"):
        for mode in ("copy", "splice"):
            ratio = best[(name, mode)] / best[("plain", mode)]
            print(f"{name:>12} {mode:>6}: {ratio:8.1f}x the plain answer's relay CPU")
            ratios[f"{name} / plain answer, {mode}"] = ratio
    for name in answers:
        ratio = best[(name, "splice")] / best[(name, "copy")]
        print(f"{name:>12} splice / copy: {ratio:.2f}")
        ratios[f"{name}: splice / copy"] = ratio
    rows = [
        {
            "answer": name,
            "MB": len(data) / 1e6,
            "copy, ms CPU": 1e3 * best[(name, "copy")],
            "splice, ms CPU": 1e3 * best[(name, "splice")],
            "tokens per CPU-second, spliced": args.tokens / best[(name, "splice")],
        }
        for name, data in answers.items()
    ]
    bench_json.write(
        args.json, "relay_floor",
        {f"{name} stream, splice, ms CPU": 1e3 * best[(name, "splice")]
         for name in ("incremental", "cumulative")},
        ratios, rows, note=f"{args.tokens}-token answers, best of {args.repeat} interleaved runs",
    )  # fmt: skip


if __name__ == "__main__":
    main()
