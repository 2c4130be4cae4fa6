"""vLLM proxy throughput: one proxy core in front of a fast vLLM-shaped stand-in, vs direct calls.

Same machinery as `benchmarks/proxy_throughput.py` (the SGLang version): the stand-in
(`benchmarks/vllm_standin.py`) and this process's load generator share core 0, the proxy runs
alone on core 1 (``taskset``); each scenario is measured direct (client → engine) and through
the proxy back to back in the same run. Printed per scenario: requests/s both ways and their
ratio, the added median latency, captured tokens/s (the proxy's ``captured`` counter × tokens
over the window), "busy" (the share of its core the proxy used, from /proc) and "per core"
(captured tokens per proxy CPU-second: what one fully loaded proxy core captures). Streams
are written a frame per token, as vLLM writes them while it decodes, 4 at a time.

The client is a plain one (asks for neither log-probs nor token ids): the proxy adds both and
sets them back to null in every answer, its most expensive case; the last row's client asks
for both, as an RL framework's does, and the proxy cuts nothing. "direct" is the client's request
sent to the engine; "same-work" is the request the proxy forwards (log-probs and ids on), sent
to the engine directly: the ratio and the added p50 are against it, since the proxy cannot
make the engine's answer smaller than what capturing needs. ``--profile`` runs the headline
scenario in process under cProfile instead and prints where the proxy's time goes, then times
`edit_answer` on both answer trees by answer size.

    python benchmarks/vllm_proxy_throughput.py [--seconds 5] [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_json  # noqa: E402
from proxy_throughput import _captured, _cpu_s, _load, _start_pair  # noqa: E402

PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "generate": "/inference/v1/generate",
}


def body(kind: str, tokens: int, stream: bool, asks: bool = False) -> dict:
    """A plain client's request; with ``asks``, the request the proxy forwards for it."""
    if kind == "generate":
        params: dict = {"max_tokens": tokens, **({"logprobs": 0} if asks else {})}
        return {"token_ids": list(range(16)), "sampling_params": params, "stream": stream}
    out: dict = {"model": "standin", "max_tokens": tokens, "stream": stream}
    if asks:
        out.update(logprobs=True if kind == "chat" else 0, return_token_ids=True)
    if kind == "chat":
        out["messages"] = [{"role": "user", "content": "hello"}]
    else:
        out["prompt"] = list(range(16))
    return out


def profile(tokens: int, rounds: int = 200) -> None:
    """Where the proxy's time goes for one non-streamed completions answer (in process)."""
    import cProfile
    import pstats

    import vllm_standin as standin

    from timwatch.sidecar.proxy.capture import CaptureStore
    from timwatch.sidecar.proxy.vllm.capture import VllmCapturer, answer_parts
    from timwatch.sidecar.proxy.vllm.edit import plan_request

    store = CaptureStore(ttl_s=5.0)
    counters = dict.fromkeys(
        (
            "wire_errors",
            "impossible_tokens",
            "sampling_mismatch_samples",
            "sampling_mismatch_tokens",
        ),
        0,
    )
    cap = VllmCapturer(store.add, counters, "raw_logprobs")
    for kind in ("completions", "chat", "generate"):
        plan = plan_request(kind, body(kind, tokens, False))
        assert plan is not None
        answer = standin.answer(standin.Req(kind, plan.body, b"bench", False))

        def run(plan=plan, answer=answer) -> None:  # type: ignore[no-untyped-def]  # noqa: B023
            for _ in range(rounds):
                _, capture = answer_parts(cap, plan, answer)
                assert capture is not None
                capture()

        run()
        t0 = time.perf_counter()
        run()
        took = time.perf_counter() - t0
        print(
            f"{kind}: {len(answer) / 1e3:.0f} kB answer, {took / rounds * 1e6:.0f} µs per answer "
            f"(edit + capture), {rounds * tokens / took / 1e6:.2f}M tokens/s on one core"
        )
        if kind == "completions":
            prof = cProfile.Profile()
            prof.runcall(run)
            pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    _trees()


def _trees() -> None:
    """`edit_answer` on each tree, by answer size, for a client that asks for log-probs and
    ids (nothing cut): where `proxy.vllm.tree.tree_of` switches from orjson to the walk."""
    import timeit

    import vllm_standin as standin

    from timwatch.sidecar.proxy.vllm import edit, tree
    from timwatch.sidecar.proxy.vllm.edit import plan_request

    print("\nedit_answer, a client that asks for log-probs and ids: the walk's tree, orjson's")
    real = edit.tree_of
    try:
        for kind in ("completions", "chat", "generate"):
            for tokens, stream in ((4096, True), (16, False), (64, False), (256, False)):
                plan = plan_request(kind, body(kind, tokens, stream, asks=True))
                assert plan is not None and not plan.changed
                req = standin.Req(kind, plan.body, b"bench", False)
                buf = standin.frames(req)[1][6:-2] if stream else standin.answer(req)
                took = []
                for cls in (tree.SpanTree, tree.ObjectTree):
                    edit.tree_of = lambda b, cut, cls=cls: cls(b)  # type: ignore[misc]
                    n = max(20, 200_000 // len(buf))
                    call = lambda: edit.edit_answer(buf, plan)  # noqa: B023, E731
                    took.append(timeit.timeit(call, number=n) / n)
                what = "a stream chunk" if stream else f"{tokens} tokens"
                print(
                    f"{kind:<12} {what:<15} {len(buf):>7,} B  walk {took[0] * 1e6:7.1f} µs  "
                    f"orjson {took[1] * 1e6:7.1f} µs  ({took[0] / took[1]:.2f}×)"
                )
    finally:
        edit.tree_of = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--quick", action="store_true", help="only the non-streamed 64-request rows")
    ap.add_argument("--profile", action="store_true", help="in-process cost breakdown only")
    bench_json.add_argument(ap)
    args = ap.parse_args()
    if args.profile:
        profile(4096)
        return
    os.sched_setaffinity(0, {0})
    # (endpoint, tokens, concurrency, streamed, the client asks for log-probs and ids)
    scenarios = [
        ("completions", 4096, 64, False, False),
        ("chat", 4096, 64, False, False),
        ("generate", 4096, 64, False, False),
        ("completions", 4096, 1, False, False),
        # a stream is a frame per token (as vLLM writes while it decodes): ~35 µs of proxy CPU
        # per frame, so 64 concurrent 4,096-token streams on one core would finish none in
        # the window; 4 concurrent ones finish dozens
        ("completions", 4096, 4, True, False),
        ("generate", 4096, 4, True, False),
        # an RL client asks for both itself: the proxy reads the chunks and cuts nothing
        ("completions", 4096, 4, True, True),
    ]
    if args.quick:
        scenarios = [s for s in scenarios if s[2] == 64]
    with ExitStack() as stack:
        e, p, pid = _start_pair(stack, "vllm", [], [])
        print(
            f"client: plain (the proxy adds log-probs and token ids and cuts them); "
            f"{args.seconds:.0f} s per cell; engine + load generator on core 0, proxy on core 1"
        )
        print(
            f"{'answer':<48}{'conc':>5}{'direct r/s':>11}{'same-work r/s':>14}{'proxy r/s':>10}"
            f"{'ratio':>7}{'+p50 ms':>9}{'captured/s':>11}{'busy':>6}{'per core':>9}"
        )
        rows: list[dict[str, object]] = []
        figures: dict[str, object] = {}
        for kind, tokens, conc, stream, asks in scenarios:
            b, path = body(kind, tokens, stream, asks=asks), PATHS[kind]
            seconds = args.seconds * (4 if stream else 1)
            d_rps, _, _ = _load(e, b, conc, seconds, path)
            w_rps, d_p50, _ = _load(e, body(kind, tokens, stream, asks=True), conc, seconds, path)
            before, cpu0 = _captured(p), _cpu_s(pid)
            t0 = time.perf_counter()
            p_rps, p_p50, _ = _load(p, b, conc, seconds, path)
            took = time.perf_counter() - t0
            captured = (_captured(p) - before) * tokens
            tok_s, busy = captured / took, (_cpu_s(pid) - cpu0) / took
            label = f"{kind} {tokens} tokens, " + ("streamed" if stream else "not streamed")
            label += ", client asks" if asks else ""
            ratio = p_rps / w_rps if w_rps else float("nan")
            print(
                f"{label:<48}{conc:>5}{d_rps:>11.1f}{w_rps:>14.1f}{p_rps:>10.1f}{ratio:>7.2f}"
                f"{p_p50 - d_p50:>+9.2f}{tok_s / 1e6:>10.2f}M{busy:>6.0%}"
                f"{tok_s / max(busy, 1e-9) / 1e6:>8.2f}M",
                flush=True,
            )
            per_core = tok_s / max(busy, 1e-9)
            rows.append(
                {
                    "answer": label,
                    "conc.": conc,
                    "direct, req/s": d_rps,
                    "same work direct, req/s": w_rps,
                    "proxy, req/s": p_rps,
                    "added p50, ms": p_p50 - d_p50,
                    "proxy busy": busy,
                    "per proxy core, tokens/s": per_core,
                }
            )
            if conc > 1:
                figures[f"{label}: captured tokens per proxy CPU-second"] = per_core
            if stream and captured:
                figures[f"{label}: proxy CPU per stream, ms"] = 1e3 * tokens / per_core
        bench_json.write(args.json, "vllm_proxy_throughput", figures, {}, rows)


if __name__ == "__main__":
    main()
