"""`timwatch sidecar vllm` in front of a real vLLM (CPU build, fp32, tiny Llama built here).

What a client receives through the proxy equals, byte for byte, what it receives from vLLM
directly for the same request (``created`` seconds aside, which vLLM makes per call), for
completions, chat and ``/inference/v1/generate``, streamed and not (a stream byte for byte
when vLLM cut both into the same chunks, else its text and frame shapes without the cuts: vLLM
coalesces tokens made between two sends, which differs between two direct calls too), whether
or not the client asked for log-probs and token ids itself. The captured samples of the
streamed and the non-streamed call of one seeded request are identical, token ids round-trip,
weight versions set with ``/update_weight_version`` appear per token, and a request sampling at
temperature ≠ 1 from an engine in raw log-prob mode is counted as a sampling-side mismatch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.helpers.procs import vllm_proxy_process
from tests.helpers.vllm import FP32_EXTRA, Engines, VllmServer

pytestmark = pytest.mark.timeout(1200)  # one vLLM start on a busy 2-core machine
# the tiny tokenizer has no chat template of its own
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "generate": "/inference/v1/generate",
}


@pytest.fixture(scope="module")
def engine(engines: Engines) -> VllmServer:
    """fp32, scale-out endpoints, chat templates from the request: the server the history
    test's fp32 capture uses too (test_vllm_engine.py), started once for both."""
    return engines.get("float32", FP32_EXTRA)


@pytest.fixture(scope="module")
def proxy(engine: VllmServer) -> Iterator[str]:
    with vllm_proxy_process(engine.url) as url:
        yield url


def _body(
    kind: str, model: str, stream: bool, client_asks: bool, **sampling: Any
) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": 24, "seed": 7, "temperature": 1.0, **sampling}
    if kind == "generate":
        params["ignore_eos"] = True
        if client_asks:
            params["logprobs"] = 0
        return {
            "model": model,
            "token_ids": [5, 6, 7, 8, 9],
            "sampling_params": params,
            "stream": stream,
        }
    out: dict[str, Any] = {"model": model, "stream": stream, "ignore_eos": True, **params}
    if kind == "chat":
        out["messages"] = [{"role": "user", "content": "hello there"}]
        out["chat_template"] = TEMPLATE
        if client_asks:
            out.update(logprobs=True, return_token_ids=True)
    else:
        out["prompt"] = [5, 6, 7, 8, 9]
        if client_asks:
            out.update(logprobs=0, return_token_ids=True)
    return out


def _post(url: str, path: str, body: dict[str, Any], rid: str) -> bytes:
    with httpx.stream(
        "POST", url + path, json=body, headers={"X-Request-Id": rid}, timeout=120
    ) as resp:
        assert resp.status_code == 200, resp.read()[:500]
        return resp.read()


def _same_call(raw: bytes) -> bytes:
    """The bytes with what vLLM makes per call (``created``) made equal."""
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def _stream_view(raw: bytes) -> tuple[str, list[bytes]]:
    """A stream without its chunking: the text in order, and the distinct consecutive frame
    shapes (every member but the text, with ids and log-probs as present-or-null)."""
    texts: list[str] = []
    shapes: list[bytes] = []
    for frame in _same_call(raw).split(b"\n\n"):
        if frame.startswith(b"data: {"):
            obj = orjson.loads(frame[6:])
            for c in obj.get("choices", []):
                texts.append(c.pop("text", None) or "")
                delta = c.get("delta")
                if isinstance(delta, dict):
                    texts.append(delta.pop("content", None) or "")
                for key in ("token_ids", "logprobs"):
                    if c.get(key) is not None:
                        c[key] = "present"
            frame = orjson.dumps(obj)
        if not shapes or shapes[-1] != frame:
            shapes.append(frame)
    return "".join(texts), shapes


def _records(proxy: str) -> dict[str, dict[str, Any]]:
    held = httpx.get(f"{proxy}/timwatch/records", timeout=30).json()["records"]
    return {r["rid"]: r for r in held}


def _counters(proxy: str) -> dict[str, int]:
    return httpx.get(f"{proxy}/timwatch/counters", timeout=10).json()["proxy"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("client_asks", [False, True], ids=["plain-client", "client-asks"])
@pytest.mark.parametrize("kind", ["completions", "chat", "generate"])
def test_client_bytes_equal_vllm_and_stream_and_answer_capture_the_same(
    engine: VllmServer, proxy: str, kind: str, client_asks: bool
) -> None:
    path = PATHS[kind]
    captured = {}
    for stream in (False, True):
        body = _body(kind, engine.model, stream, client_asks)
        rid = f"{kind}-{client_asks}-{stream}"
        direct = _post(engine.url, path, body, rid)
        through = _post(proxy, path, body, rid)
        if _same_call(through) != _same_call(direct):
            # vLLM coalesces the tokens made between two sends into one chunk, so where a
            # stream is cut differs between two direct calls too: then compare frame shapes
            assert stream, kind
            assert _stream_view(through) == _stream_view(direct), kind
        prefix = {"completions": "cmpl-", "chat": "chatcmpl-", "generate": "generate-tokens-"}
        captured[stream] = _records(proxy)[prefix[kind] + rid]
        # the ids the client would get by asking for them
        asked = _body(kind, engine.model, False, True)
        answer = orjson.loads(_post(engine.url, path, asked, rid + "-ids"))
        assert captured[stream]["output_ids"] == answer["choices"][0]["token_ids"]
        assert len(captured[stream]["output_ids"]) == 24
    plain, streamed = captured[False], captured[True]
    assert plain["output_ids"] == streamed["output_ids"]
    assert plain["logp"] == streamed["logp"]
    assert plain["input_ids"] == streamed["input_ids"] and plain["input_ids"]
    assert all(lp <= 0.0 for lp in plain["logp"])
    assert plain["engine"] == "vllm" and plain["logprobs_mode"] == "raw_logprobs"
    assert plain["sampling"] == {"temperature": 1.0, "seed": 7}
    assert _counters(proxy)["wire_errors"] == 0


def test_weight_versions_from_the_engine_are_per_token(engine: VllmServer, proxy: str) -> None:
    answer = httpx.post(
        f"{engine.url}/update_weight_version", json={"new_version": "7"}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    for stream in (False, True):
        body = _body("generate", engine.model, stream, False)
        _post(proxy, PATHS["generate"], body, f"versions-{stream}")
        rec = _records(proxy)[f"generate-tokens-versions-{stream}"]
        assert rec["versions"] == ["7"] * 24


def test_temperature_with_raw_logprobs_is_a_sampling_side_mismatch(
    engine: VllmServer, proxy: str
) -> None:
    before = _counters(proxy)
    body = _body("completions", engine.model, False, False, temperature=0.7)
    _post(proxy, PATHS["completions"], body, "hot")
    after = _counters(proxy)
    assert after["sampling_mismatch_samples"] == before["sampling_mismatch_samples"] + 1
    assert after["sampling_mismatch_tokens"] == before["sampling_mismatch_tokens"] + 24
    assert _records(proxy)["cmpl-hot"]["sampling"]["temperature"] == 0.7
