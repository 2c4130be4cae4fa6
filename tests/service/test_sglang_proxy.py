"""SGLang sidecar proxy end to end: real uvicorn processes on loopback.

SGLang needs a GPU, so ``tests/helpers/fake_sglang.py`` stands in for it, answering in SGLang
0.5.x's wire format (see its docstring for the SGLang source files it follows). Each test compares
what a client gets through the proxy with what it gets from the stand-in directly, and checks what
the sidecar captured against the stand-in's exact float64 model.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.helpers.fake_sglang as fake
from tests.helpers.procs import fake_sglang_process, sglang_proxy_process
from timwatch.sidecar.proxy.capture import CaptureStore
from timwatch.sidecar.proxy.records import RolloutRecord, topk_entropy_bounds
from timwatch.sidecar.proxy.sglang.wire import SampleState, WireError, plan_request

TOPK = 5


# ---------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def fake_cum() -> Iterator[str]:
    with fake_sglang_process(incremental=False) as url:
        yield url


@pytest.fixture(scope="module")
def fake_inc() -> Iterator[str]:
    with fake_sglang_process(incremental=True) as url:
        yield url


@pytest.fixture(scope="module")
def proxy_cum(fake_cum: str) -> Iterator[str]:
    extra = ["--topk", str(TOPK), "--vocab-size", str(fake.VOCAB), "--probe-rate", "1"]
    with sglang_proxy_process(fake_cum, *extra) as url:
        yield url


@pytest.fixture(scope="module")
def proxy_inc(fake_inc: str) -> Iterator[str]:
    with sglang_proxy_process(
        fake_inc, "--topk", str(TOPK), "--vocab-size", str(fake.VOCAB)
    ) as url:
        yield url


@pytest.fixture(scope="module")
def proxy_plain(fake_cum: str) -> Iterator[str]:
    with sglang_proxy_process(fake_cum, "--timeout", "1") as url:
        yield url


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("fake_cum", "fake_inc"):
        if name in request.fixturenames:
            url = request.getfixturevalue(name)
            httpx.post(f"{url}/fake/config", json={})
            httpx.post(f"{url}/update_weight_version", json={"new_version": "default"})


MODES = {"cumulative": ("fake_cum", "proxy_cum"), "incremental": ("fake_inc", "proxy_inc")}


@pytest.fixture(params=sorted(MODES))
def pair(request: pytest.FixtureRequest) -> tuple[str, str]:
    f, p = MODES[request.param]
    return request.getfixturevalue(f), request.getfixturevalue(p)


# ---------------------------------------------------------------- helpers


def generate(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=30)


def stream(url: str, body: dict[str, Any]) -> list[Any]:
    frames: list[Any] = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        raw = resp.read()
    for frame in raw.split(b"\n\n"):
        if not frame:
            continue
        assert frame.startswith(b"data: "), frame
        payload = frame[6:]
        frames.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    assert frames[-1] == "[DONE]"
    return frames


def records(proxy: str) -> dict[str, RolloutRecord]:
    got = httpx.get(f"{proxy}/timwatch/records").json()["records"]
    return {r["rid"]: RolloutRecord.from_dict(r) for r in got}


def check_record(rec: RolloutRecord, prompt: list[int], *, topk: bool = True) -> None:
    """μ, ids and entropy bounds against the stand-in's exact model (float64)."""
    assert rec.input_ids is not None and rec.input_ids.tolist() == prompt
    assert len(rec.output_ids) == len(rec.logp) > 0
    ids = rec.output_ids.tolist()
    for t, tok in enumerate(ids):
        dist = fake.distribution(prompt + ids[:t])
        assert rec.logp[t] == pytest.approx(dist[tok], abs=1e-12)
        if not topk:
            continue
        assert rec.entropy_lower is not None and rec.entropy_tail is not None
        exact = fake.entropy(dist)
        probs = sorted((math.exp(x) for x in dist), reverse=True)[:TOPK]
        head = -sum(p * math.log(p) for p in probs)
        mass = 1.0 - sum(probs)
        assert rec.entropy_lower[t] == pytest.approx(head + mass * -math.log(probs[-1]), abs=1e-9)
        assert rec.entropy_tail[t] == pytest.approx(
            mass * math.log((fake.VOCAB - TOPK) / mass), abs=1e-9
        )
        assert rec.entropy_lower[t] <= exact + 1e-12
        assert exact <= head + rec.entropy_tail[t] + 1e-12
    assert rec.entropy_source == ("topk" if topk else None)


def upstream_request(fake_url: str, rid: str) -> dict[str, Any]:
    seen = httpx.get(f"{fake_url}/fake/requests").json()
    return [r for r in seen if r.get("rid") == rid][-1]


# ---------------------------------------------------------------- end to end


def test_plain_client_gets_sglang_answer_and_sidecar_captures(fake_cum, proxy_cum) -> None:
    body = {"text": "the cat sat", "rid": "plain-1", "sampling_params": {"max_new_tokens": 7}}
    direct, proxied = generate(fake_cum, body), generate(proxy_cum, body)
    assert proxied.status_code == direct.status_code == 200
    assert proxied.json() == direct.json()
    assert "output_token_logprobs" not in proxied.json()["meta_info"]
    sent = upstream_request(fake_cum, "plain-1")
    assert sent["return_logprob"] is True and sent["top_logprobs_num"] == TOPK
    assert sent["return_prompt_token_ids"] is True
    rec = records(proxy_cum)["plain-1"]
    check_record(rec, fake.tokenize("the cat sat"))
    assert list(rec.output_ids) == direct.json()["output_ids"]
    assert rec.versions == ("default",) * len(rec.output_ids)
    assert rec.finish_reason in ("stop", "length")


def test_client_logprobs_kept_and_smaller_topk_trimmed(fake_cum, proxy_cum) -> None:
    body = {
        "input_ids": [5, 9, 11, 2],
        "rid": "lp-1",
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 5},
    }
    direct, proxied = generate(fake_cum, body).json(), generate(proxy_cum, body).json()
    assert proxied == direct
    assert all(len(row) == 2 for row in proxied["meta_info"]["output_top_logprobs"])
    check_record(records(proxy_cum)["lp-1"], [5, 9, 11, 2])


@pytest.mark.parametrize("kind", ["single", "batch"])
def test_streams_unchanged_and_captured(pair, kind) -> None:
    fake_url, proxy = pair
    if kind == "single":
        body: dict[str, Any] = {"text": "stream me", "rid": f"s-{proxy[-5:]}"}
        prompts, rids = ["stream me"], [body["rid"]]
    else:
        prompts, rids = ["alpha", "beta gamma"], [f"b0-{proxy[-5:]}", f"b1-{proxy[-5:]}"]
        body = {"text": prompts, "rid": rids}
    body.update(stream=True, sampling_params={"max_new_tokens": 6})
    assert stream(proxy, body) == stream(fake_url, body)
    got = records(proxy)
    for prompt, rid in zip(prompts, rids, strict=True):
        check_record(got[rid], fake.tokenize(prompt))
        plain = dict(body, stream=False, text=prompt, rid=rid + "-ns")
        assert list(got[rid].output_ids) == generate(fake_url, plain).json()["output_ids"]


def test_batch_with_parallel_samples(fake_cum, proxy_cum) -> None:
    body = {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 4, "n": 2}}
    direct, proxied = generate(fake_cum, body).json(), generate(proxy_cum, body).json()
    assert len(proxied) == len(direct) == 4
    strip = [{**o, "meta_info": {**o["meta_info"], "id": None}} for o in direct]
    assert [{**o, "meta_info": {**o["meta_info"], "id": None}} for o in proxied] == strip
    got = records(proxy_cum)
    for k, out in enumerate(proxied):
        rec = got[out["meta_info"]["id"]]
        check_record(rec, fake.tokenize(["one", "two"][k // 2]))
        assert list(rec.output_ids) == out["output_ids"]


@pytest.mark.parametrize("streamed", [False, True])
def test_aborted_samples(pair, streamed) -> None:
    fake_url, proxy = pair
    httpx.post(f"{fake_url}/fake/config", json={"abort_after": 3})
    body = {"text": "abort", "rid": f"ab-{streamed}", "stream": streamed}
    body["sampling_params"] = {"max_new_tokens": 9}
    if streamed:
        assert stream(proxy, body) == stream(fake_url, body)
    else:
        assert generate(proxy, body).json() == generate(fake_url, body).json()
    rec = records(proxy)[f"ab-{streamed}"]
    assert rec.finish_reason == "abort" and len(rec.output_ids) == 3
    check_record(rec, fake.tokenize("abort"))


def test_weight_version_spans_become_per_token_versions(fake_cum, proxy_cum) -> None:
    httpx.post(f"{proxy_cum}/update_weight_version", json={"new_version": "3"})
    assert httpx.get(f"{proxy_cum}/model_info").json()["weight_version"] == "3"
    httpx.post(f"{fake_cum}/fake/config", json={"switch_at": 2, "next_version": "4"})
    body = {"input_ids": [1, 2, 3], "rid": "wv-1", "sampling_params": {"max_new_tokens": 5}}
    body["sampling_params"]["seed"] = 3  # a seed whose sample does not stop before 3 tokens
    answer = generate(proxy_cum, body).json()
    spans = answer["meta_info"]["weight_versions"]
    assert spans[0] == {"version": "3", "start": 0, "end": 2}
    rec = records(proxy_cum)["wv-1"]
    n = len(rec.output_ids)
    assert n >= 3
    assert rec.versions == ("3", "3") + ("4",) * (n - 2)
    assert rec.versions_as_int() == [3, 3] + [4] * (n - 2)
    assert rec.weight_version == "4"


@pytest.mark.parametrize("status", [500, 400])
def test_upstream_errors_pass_back_unchanged(fake_cum, proxy_cum, status) -> None:
    httpx.post(f"{fake_cum}/fake/config", json={"fail_status": status})
    body = {"text": "x", "rid": "err"}
    direct, proxied = generate(fake_cum, body), generate(proxy_cum, body)
    assert proxied.status_code == direct.status_code == status
    assert proxied.content == direct.content
    assert httpx.get(f"{proxy_cum}/timwatch/healthz").status_code == 200


def test_upstream_timeout_is_a_gateway_timeout(fake_cum, proxy_plain) -> None:
    httpx.post(f"{fake_cum}/fake/config", json={"delay_s": 2.5})
    resp = generate(proxy_plain, {"text": "slow", "rid": "slow"})
    assert resp.status_code == 504
    assert fake_cum in resp.json()["error"]["message"]
    assert httpx.get(f"{proxy_plain}/timwatch/healthz").status_code == 200


def test_without_topk_only_logprobs_are_captured(fake_cum, proxy_plain) -> None:
    body = {"text": "no top", "rid": "plain-notop", "sampling_params": {"max_new_tokens": 4}}
    assert generate(proxy_plain, body).json() == generate(fake_cum, body).json()
    assert "top_logprobs_num" not in upstream_request(fake_cum, "plain-notop")
    rec = records(proxy_plain)["plain-notop"]
    check_record(rec, fake.tokenize("no top"), topk=False)
    assert rec.entropy_lower is None


def test_prefill_probe_reports_decode_vs_prefill(fake_cum, proxy_cum) -> None:
    noise = 1e-3
    httpx.post(f"{fake_cum}/fake/config", json={"prefill_noise": noise})
    prompt = [7, 8, 9, 10]
    generate(proxy_cum, {"input_ids": prompt, "rid": "probe-1"})
    deadline = time.monotonic() + 10
    while True:
        results = httpx.get(f"{proxy_cum}/timwatch/probes").json()["results"]
        hit = [r for r in results if r["rid"] == "probe-1"]
        if hit or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert hit, "probe result missing"
    r = hit[0]
    assert r["same_version"] is True
    ids = r["output_ids"]
    probe = [q for q in httpx.get(f"{fake_cum}/fake/requests").json() if "rid" not in q][-1]
    assert probe["input_ids"] == prompt + ids and probe["top_logprobs_num"] == TOPK
    assert probe["sampling_params"] == {"max_new_tokens": 0} and probe["logprob_start_len"] == 0
    for t, tok in enumerate(ids):
        prefix = prompt + ids[:t]
        dec, pre = fake.distribution(prefix), fake.prefill_distribution(prefix, noise)
        assert r["logp_decode"][t] == pytest.approx(dec[tok], abs=1e-12)
        assert r["logp_prefill"][t] == pytest.approx(pre[tok], abs=1e-12)
        assert r["logp_prefill"][t] != r["logp_decode"][t]
        probs = sorted((math.exp(x) for x in pre), reverse=True)[:TOPK]
        bound = -sum(p * math.log(p) for p in probs) + (1 - sum(probs)) * -math.log(probs[-1])
        assert r["entropy_prefill"][t] == pytest.approx(bound, abs=1e-9)
        assert r["entropy_prefill"][t] <= fake.entropy(pre) + 1e-12


def test_other_paths_pass_through(fake_cum, proxy_cum) -> None:
    assert httpx.get(f"{proxy_cum}/model_info").json() == httpx.get(f"{fake_cum}/model_info").json()
    resp = httpx.post(f"{proxy_cum}/abort_request", json={"rid": "nothing"})
    assert resp.status_code == 200 and resp.content == b""


# ---------------------------------------------------------------- units


def _rec(rid: str, ids: tuple[int, ...]) -> RolloutRecord:
    return RolloutRecord(rid, (1,), ids, (-0.5,) * len(ids), ("0",) * len(ids), "stop", "0")


def test_capture_store_pops_by_rid_and_tokens_and_expires() -> None:
    now = [0.0]
    store = CaptureStore(ttl_s=10.0, clock=lambda: now[0])
    store.add(_rec("a", (1, 2)))
    store.add(_rec("b", (1, 2)))
    store.add(_rec("c", (3,)))
    assert store.pop_by_tokens([1, 2]).rid == "a"  # oldest first
    assert store.pop_by_rid("b").rid == "b"
    assert store.pop_by_tokens([1, 2]) is None and store.pop_by_rid("b") is None
    now[0] = 10.5
    assert store.pop_by_rid("c") is None
    assert store.counters.expired == 1 and store.counters.popped == 2 and len(store) == 0


def test_wire_errors_name_field_and_index() -> None:
    out = {"meta_info": {"id": "x", "output_token_logprobs": [[-0.1, 3, None], [-0.2, "7"]]}}
    with pytest.raises(WireError, match=r"output_token_logprobs\[1\]\[1\]"):
        SampleState().feed(out, stream=False)


def test_plan_leaves_complete_requests_alone() -> None:
    body = {"input_ids": [1], "return_logprob": True, "top_logprobs_num": 8}
    plan = plan_request(body, topk=5)
    assert plan is not None and not plan.changed and plan.body == body


def test_entropy_bounds_hand_computed() -> None:
    # p = (0.5, 0.25) over a vocabulary of 4; rest mass 0.25 over 2 tokens. The second row
    # is shorter and has a null (probability 0): mass 0.5 beside p = 0.5, 3 tokens left.
    lower, tail = topk_entropy_bounds(
        [[math.log(0.5), math.log(0.25)], [math.log(0.5)], [math.log(0.5), None]], vocab_size=4
    )
    head = 0.5 * math.log(2) + 0.25 * math.log(4)
    assert lower[0] == pytest.approx(head + 0.25 * math.log(4))
    assert tail is not None and tail[0] == pytest.approx(0.25 * math.log(2 / 0.25))
    # the true maximum-entropy completion (0.125, 0.125) hits the upper bound H_S + tail exactly
    assert head + tail[0] == pytest.approx(head + 2 * 0.125 * math.log(8))
    assert lower[1] == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2))
    assert tail[1] == pytest.approx(0.5 * math.log(3 / 0.5))
    assert lower[2] == pytest.approx(lower[1]) and tail[2] == pytest.approx(0.5 * math.log(2 / 0.5))
    # an array of rows gives the same bounds as its lists; without V there is no tail
    rows = np.log(np.array([[0.5, 0.25], [0.9, 0.05]]))
    assert topk_entropy_bounds(rows)[1] is None
    assert np.array_equal(topk_entropy_bounds(rows)[0], topk_entropy_bounds(rows.tolist())[0])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.floats(-8.0, 3.0), min_size=3, max_size=40), min_size=1, max_size=4),
    st.integers(1, 40),
)
def test_entropy_bounds_bracket_the_true_entropy(dists: list[list[float]], k: int) -> None:
    rows, exact, head, vocab = [], [], [], min(len(d) for d in dists)
    for logits in dists:
        logits = logits[:vocab]
        top = max(logits)
        z = math.fsum(math.exp(x - top) for x in logits)
        logps = [x - top - math.log(z) for x in logits]
        exact.append(-math.fsum(math.exp(lp) * lp for lp in logps))
        rows.append(sorted(logps, reverse=True)[: min(k, vocab)])
        head.append(-math.fsum(math.exp(lp) * lp for lp in rows[-1]))
    lower, tail = topk_entropy_bounds(rows, vocab_size=vocab)
    assert tail is not None
    for i, h in enumerate(exact):
        assert lower[i] <= h + 1e-9
        assert h <= head[i] + tail[i] + 1e-9
