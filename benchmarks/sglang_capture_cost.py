"""CPU the SGLang proxy spends capturing one non-streamed answer, in process (no HTTP).

The answer is the stand-in's (`benchmarks/sglang_standin.py`, SGLang's compact orjson bytes,
``return_logprob`` without top-k). Timed, best of 7 repeats, on the C reader (the byte path) and
on the orjson fallback (the object path), interleaved: the client's bytes and the capture
(`answers.answer_parts` and the capture it returns: reading the log-probs, building the held
record, adding it to a `CaptureStore`), each answer with a fresh id; and, for a client that did
not ask for log-probs, the client's bytes with what the proxy added cut out (on the response
path). `proxy_throughput.py` measures the whole request through a real proxy.

    python benchmarks/sglang_capture_cost.py [--tokens 4096] [--number 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_standin as standin  # noqa: E402

from timwatch.sidecar.proxy import native  # noqa: E402
from timwatch.sidecar.proxy.capture import CaptureStore  # noqa: E402
from timwatch.sidecar.proxy.sglang.answers import Capturer, answer_parts  # noqa: E402
from timwatch.sidecar.proxy.sglang.wire import plan_request  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--number", type=int, default=300)
    args = ap.parse_args()
    n = args.tokens
    rid = b"%032x" % 1
    answer = standin.answer_bytes(n, answer_id=1)
    request = {"input_ids": list(range(16)), "sampling_params": {"max_new_tokens": n}}
    logprobs = plan_request(dict(request, return_logprob=True), None)
    plain = plan_request(request, None)
    assert logprobs is not None and plain is not None
    store = CaptureStore(ttl_s=30)
    cap = Capturer(store.add, {"wire_errors": 0}, None)
    count = [0]

    def capture() -> None:
        count[0] += 1
        body = answer.replace(rid, b"%032x" % count[0], 1)
        _, later = answer_parts(cap, logprobs, body)
        if later is not None:  # the byte path defers the capture; the object path ran it
            later()

    def best(fn: Callable[[], object]) -> float:
        times = timeit.repeat(fn, number=args.number, repeat=7)
        return 1e6 * min(times) / args.number

    def restore() -> bytes:
        client, later = answer_parts(cap, plain, answer)
        assert later is None or native.cstream() is not None
        return client

    print(f"load average {os.getloadavg()[0]:.2f}; {n}-token answer, {len(answer)} bytes")
    readers = ("C", "fallback") if native.built() else ("fallback",)
    results: dict[str, list[tuple[float, float]]] = {r: [] for r in readers}
    for _ in range(2):  # interleaved: the machine's drift hits both alike
        for name in readers:
            native.use_native(name == "C")
            before = store.counters.captured
            capture()
            assert store.counters.captured == before + 1, "the answer was not captured"
            results[name].append((best(capture), best(restore)))
    for name, runs in results.items():
        print(
            f"{name:9} capture {min(r[0] for r in runs):6.0f} us; client bytes for a client "
            f"without log-probs {min(r[1] for r in runs):6.0f} us"
        )


if __name__ == "__main__":
    main()
