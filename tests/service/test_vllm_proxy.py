"""`timwatch sidecar vllm` against a stand-in that answers in vLLM 0.32's shapes.

The stand-in (`benchmarks/vllm_standin.py`) is NOT evidence of compatibility with vLLM: it
writes the shapes read from vLLM's source with orjson and a fixed token sequence. It gives fast
coverage of the proxy's byte editing and capture (long answers, stream chunks split across
reads, -9999 log-probs, weight-version spans); tests/engine/test_vllm_proxy.py is the evidence
against a real vLLM. Real uvicorn processes on loopback.
"""

from __future__ import annotations

import asyncio
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.helpers.procs import REPO, ServerProc, vllm_proxy_process, vllm_standin_process
from tests.helpers.readers import require_c
from timwatch.monitor.core.errors import NotFast, WireError
from timwatch.sidecar.proxy.native import walk
from timwatch.sidecar.proxy.vllm.capture import COUNTER_NAMES, VllmCapturer, relay_stream
from timwatch.sidecar.proxy.vllm.edit import edit_answer, plan_request, truncates

sys.path.insert(0, str(Path(REPO) / "benchmarks"))
import vllm_standin as standin  # noqa: E402

PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "generate": "/inference/v1/generate",
}
TOKENS = 1500  # past 997: one -9999 (impossible) token per sample


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with vllm_standin_process("--versions") as url:
        yield url


@pytest.fixture(scope="module")
def proxy(upstream: str) -> Iterator[str]:
    with vllm_proxy_process(upstream, "--logprobs-mode", "processed_logprobs") as url:
        yield url


def _body(kind: str, stream: bool, asks: bool, **extra: Any) -> dict[str, Any]:
    if kind == "generate":
        params: dict[str, Any] = {"max_tokens": TOKENS, **extra}
        if asks:
            params["logprobs"] = 0
        return {"token_ids": [3, 1, 4], "sampling_params": params, "stream": stream}
    out: dict[str, Any] = {"max_tokens": TOKENS, "stream": stream, **extra}
    if kind == "chat":
        out["messages"] = [{"role": "user", "content": "x"}]
        if asks:
            out.update(logprobs=True, return_token_ids=True)
    else:
        out["prompt"] = [3, 1, 4]
        if asks:
            out.update(logprobs=0, return_token_ids=True)
    return out


def _post(url: str, kind: str, body: dict[str, Any], rid: str) -> bytes:
    with httpx.stream(
        "POST", url + PATHS[kind], json=body, headers={"X-Request-Id": rid}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        return resp.read()


def _same_call(raw: bytes) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def _expected(n: int) -> tuple[list[int], list[float]]:
    toks = [standin.token(i) for i in range(n)]
    return [t for t, _, _ in toks], [-math.inf if lp <= -9999 else lp for _, lp, _ in toks]


@pytest.mark.parametrize("asks", [False, True], ids=["plain-client", "client-asks"])
@pytest.mark.parametrize("kind", ["completions", "chat", "generate"])
def test_client_gets_the_upstream_bytes_and_the_sample_is_captured(
    upstream: str, proxy: str, kind: str, asks: bool
) -> None:
    prefix = {"completions": "cmpl-", "chat": "chatcmpl-", "generate": "generate-tokens-"}
    ids, logps = _expected(TOKENS)
    for stream in (False, True):
        rid = f"{kind}-{asks}-{stream}"
        body = _body(kind, stream, asks, temperature=0.6)
        direct = _post(upstream, kind, body, rid)
        through = _post(proxy, kind, body, rid)
        assert _same_call(through) == _same_call(direct)
        held = httpx.get(f"{proxy}/timwatch/records", timeout=30).json()["records"]
        rec = {r["rid"]: r for r in held}[prefix[kind] + rid]
        assert rec["output_ids"] == ids
        got = rec["logp"]  # -inf is listed as null
        assert [g for g in got if g is not None] == [x for x in logps if x != -math.inf]
        assert [i for i, g in enumerate(got) if g is None] == [996]
        assert rec["input_ids"] == ([3, 1, 4] if kind != "chat" else [1, 2, 3, 4])
        assert rec["sampling"] == {"temperature": 0.6}
        assert rec["logprobs_mode"] == "processed_logprobs"
        if kind == "generate":
            half = TOKENS // 2
            assert rec["versions"] == ["1"] * half + ["2"] * (TOKENS - half)
    counters = httpx.get(f"{proxy}/timwatch/counters", timeout=10).json()["proxy"]
    assert counters["wire_errors"] == 0
    # processed log-probs: temperature 0.6 is what was sampled, no sampling-side mismatch
    assert counters["sampling_mismatch_samples"] == 0


def test_raw_logprobs_with_temperature_is_counted_and_exported(upstream: str) -> None:
    with vllm_proxy_process(upstream) as proxy:
        _post(proxy, "completions", _body("completions", False, False, temperature=0.5), "a")
        _post(proxy, "generate", _body("generate", True, False, top_p=0.9), "b")
        _post(proxy, "chat", _body("chat", False, False, temperature=1.0), "c")
        counters = httpx.get(f"{proxy}/timwatch/counters", timeout=10).json()["proxy"]
        metrics = httpx.get(f"{proxy}/timwatch/metrics", timeout=10).text
    assert counters["sampling_mismatch_samples"] == 2
    assert counters["sampling_mismatch_tokens"] == 2 * TOKENS
    assert counters["impossible_tokens"] == 3
    assert "timwatch_sidecar_vllm_sampling_mismatch_samples_total 2\n" in metrics
    assert f"timwatch_sidecar_vllm_sampling_mismatch_tokens_total {2 * TOKENS}\n" in metrics
    assert "timwatch_sidecar_vllm_impossible_tokens_total 3\n" in metrics


def test_other_paths_and_errors_pass_through(upstream: str, proxy: str) -> None:
    assert httpx.get(f"{proxy}/health", timeout=10).status_code == 200
    assert httpx.get(f"{proxy}/v1/nothing", timeout=10).status_code == 404
    # echo is left alone: vLLM's answer to it is passed through and not captured
    before = httpx.get(f"{proxy}/timwatch/counters", timeout=10).json()["proxy"]
    body = dict(_body("completions", False, False), echo=True, max_tokens=5)
    assert _same_call(_post(proxy, "completions", body, "e")) == _same_call(
        _post(upstream, "completions", body, "e")
    )
    after = httpx.get(f"{proxy}/timwatch/counters", timeout=10).json()["proxy"]
    assert after["uncaptured_requests"] == before["uncaptured_requests"] + 1


def test_joined_batch_reaches_the_monitor_with_its_impossible_token(
    upstream: str, server: ServerProc
) -> None:
    """μ of -9999 (vLLM's -inf) joined with the trainer's π reaches `timwatch serve` as an
    impossible token: counted in the step and the exposition, left out of the metrics."""
    with vllm_proxy_process(upstream, "--monitor", server.url, "--run", "vllm-join") as proxy:
        body = _body("completions", False, False)
        _post(proxy, "completions", body, "join")
        ids, logps = _expected(TOKENS)
        pi = [(-0.5 if lp == -math.inf else lp - 0.01) for lp in logps]
        report = {
            "step": 3,
            "samples": [{"rid": "cmpl-join", "logp_train": pi, "entropy": [1.0] * TOKENS}],
        }
        answer = httpx.post(f"{proxy}/timwatch/v1/trainer_reports", json=report, timeout=30)
        assert answer.status_code == 200, answer.text
        for _ in range(100):  # the tap ships from its own thread
            got = httpx.get(f"{server.url}/v1/runs/vllm-join/steps/3", timeout=10)
            if got.status_code == 200:
                break
            time.sleep(0.1)
        join = httpx.get(f"{proxy}/timwatch/v1/join", timeout=10).text
        assert got.status_code == 200, (join, server.output()[-3000:])
        row = got.json()["row"]
    assert row["impossible_tokens"] == 1, {k: row[k] for k in ("tokens", "nonfinite_tokens")}
    assert row["tokens"] == TOKENS - 1
    d = -0.01  # every possible token has δ = π − μ = -0.01
    assert row["mismatch_kl"] == pytest.approx(math.exp(d) - 1 - d, rel=1e-6)
    exposition = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'timwatch_impossible_tokens_total{run="vllm-join"} 1.0' in exposition


def test_sidecar_metrics_pass_promtool(upstream: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (scripts/test.sh installs it)")
    with vllm_proxy_process(upstream) as proxy:
        _post(proxy, "completions", _body("completions", False, False, top_k=5), "p")
        text = httpx.get(f"{proxy}/timwatch/metrics", timeout=10).text
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------ in process


def test_walk_spans_are_whole_values_even_with_keys_inside_strings() -> None:
    require_c()
    doc = {
        "a": 'x","choices":[1]}',
        "choices": [{"logprobs": {"content": [{"logprob": -1.5, "token": '\\"{'}]}}],
        "b": [1, {"c": None}],
    }
    raw = orjson.dumps(doc)
    rows = walk(raw, 4, 2)
    assert rows.shape[0] > 0
    keys = {raw[r[2] : r[3]]: raw[r[4] : r[5]] for r in rows.tolist() if r[2] >= 0}
    for key in (b"a", b"choices", b"logprobs", b"b"):
        value = keys[key]
        assert orjson.loads(value) is not None
    assert orjson.loads(keys[b"choices"]) == doc["choices"]
    assert walk(b'{"a":[1,2}', 4, 2).shape[0] == 0
    assert walk(b'{"a":1} x', 4, 2).shape[0] == 0
    assert walk(b'{"a":"abc\\"}', 4, 2).shape[0] == 0


def test_malformed_answers_are_refused_not_guessed() -> None:
    plan = plan_request("completions", {"prompt": "x"})
    assert plan is not None and plan.cut_logprobs and plan.cut_ids
    with pytest.raises(NotFast):
        edit_answer(b"[1,2]", plan)
    with pytest.raises(NotFast):
        edit_answer(b'{"error":{"message":"x"}}', plan)
    bad_ids = (
        b'{"id":"x","choices":[{"index":0,"logprobs":{"token_logprobs":[-1.0]},"token_ids":null}]}'
    )
    with pytest.raises(WireError, match="token_ids"):
        edit_answer(bad_ids, plan)
    short = (
        b'{"id":"x","choices":[{"index":0,"logprobs":{"token_logprobs":[-1.0]},"token_ids":[1,2]}]}'
    )
    with pytest.raises(WireError, match="1 log-probs for 2 token ids"):
        edit_answer(short, plan)
    nan = b'{"id":"x","choices":[{"index":0,"logprobs":{"token_logprobs":["a"]},"token_ids":[1]}]}'
    with pytest.raises(WireError, match="numbers"):
        edit_answer(nan, plan)


def test_plans_leave_what_the_client_asked_for_and_skip_what_they_cannot_undo() -> None:
    asks = plan_request("completions", {"logprobs": 2, "return_token_ids": True})
    assert asks is not None and not asks.changed
    chat = plan_request("chat", {"messages": [], "top_logprobs": 0})
    assert chat is not None and chat.body["logprobs"] is True and chat.cut_logprobs
    assert plan_request("chat", {"messages": [], "top_logprobs": 3}) is None
    assert plan_request("completions", {"echo": True}) is None
    assert plan_request("completions", [1, 2]) is None
    assert plan_request("generate", {"token_ids": "x", "sampling_params": {}}) is None
    gen = plan_request("generate", {"token_ids": [1], "sampling_params": {"top_k": 5}})
    assert gen is not None and gen.body["sampling_params"] == {"top_k": 5, "logprobs": 0}
    assert gen.prompt_ids == [1] and not gen.cut_ids


def test_truncation_rule() -> None:
    assert not truncates({})
    assert not truncates({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0})
    assert not truncates({"top_k": 0, "seed": 3})
    for params in ({"temperature": 0.7}, {"temperature": 0}, {"top_p": 0.95}, {"top_k": 40}):
        assert truncates(params), params
    assert truncates({"min_p": 0.05})


def test_edit_keeps_everything_but_the_added_members() -> None:
    plan = plan_request("completions", {"prompt": "x", "max_tokens": 30})
    assert plan is not None
    r = standin.Req("completions", plan.body, b"r", False)
    client, parts, info = edit_answer(standin.answer(r), plan)
    plain = standin.answer(
        standin.Req("completions", {"prompt": "x", "max_tokens": 30}, b"r", False)
    )
    assert _same_call(client) == _same_call(plain)
    assert info["id"] == "cmpl-r"
    (part,) = parts
    assert part.ids.tolist() == _expected(30)[0]
    np.testing.assert_array_equal(part.logps, np.array(_expected(30)[1]))


def test_a_stream_capture_that_fails_leaves_the_client_bytes_and_is_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in the capture must not break the client's stream: the frames still come out as
    the client would have had them, the failure is counted as a wire error, and the choice is
    not captured (the next stream is)."""
    plan = plan_request("completions", {"prompt": "x", "max_tokens": 30, "stream": True})
    assert plan is not None
    wire = b"".join(standin.frames(standin.Req("completions", plan.body, b"r", False)))
    got: list[Any] = []
    counters = {name: 0 for name in COUNTER_NAMES}
    cap = VllmCapturer(got.append, counters, "raw_logprobs")

    def relayed() -> bytes:
        async def chunks() -> AsyncIterator[bytes]:
            for at in range(0, len(wire), 700):
                yield wire[at : at + 700]

        async def run() -> bytes:
            return b"".join([c async for c in relay_stream(cap, plan, chunks())])

        return asyncio.run(run())

    want = relayed()
    assert counters["wire_errors"] == 0 and len(got) == 1

    def broken(*args: Any) -> None:
        raise RuntimeError("a capture bug")

    monkeypatch.setattr(VllmCapturer, "finish", broken)
    assert relayed() == want
    assert counters["wire_errors"] == 1 and len(got) == 1


def test_a_logits_mode_is_refused_at_the_command_line() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "timwatch", "sidecar", "vllm", "--upstream", "http://127.0.0.1:9"]
        + ["--logprobs-mode", "raw_logits"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "--logprobs-mode must be one of raw_logprobs, processed_logprobs" in res.stderr
