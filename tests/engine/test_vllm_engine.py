"""A real vLLM engine (CPU build, bf16 and fp32, one server at a time) against a plain-torch fp32
trainer on the same weights, ingested into a real ``timwatch serve``.

Each server is started once per module by a fixture that makes every request the tests need and
stops it before returning (so the two never overlap): `bf16` (``--enable-scale-out``, dev mode:
completions, a streamed twin, temperature 0.7, and token-in token-out generations across weight
reloads, one of them while the request is in flight) and `fp32` (the same completions). The
trainer side is `timwatch.sidecar.demo.llama` (fp32 torch, no vLLM code); the tokenizer side is
the model's own tokenizer in the vLLM venv (transformers).

What could fail: the engine's precision (bf16 mismatch ≥ 1e4 × fp32's, in the history), token
ids (the tokenizer's ids, not re-derived from text), a reload that does not take effect or whose
tokens are labelled with the wrong version, and vLLM's raw log-prob mode at temperature ≠ 1.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.helpers.procs import ServerProc
from tests.helpers.vllm import FP32_EXTRA, Engines, tokenizer_roundtrip
from timwatch.sidecar.demo import llama
from timwatch.sidecar.demo.vllm_engine import EngineClient, Generation
from timwatch.sidecar.tap import Tap

pytestmark = pytest.mark.timeout(1200)  # two vLLM starts on a busy 2-core machine

PROMPTS = [
    "def hello(x):",
    "Return the number of items in a container.",
    "The default value is None, which means",
    "import json\nimport os\n",
    "class Counter(dict):",
    "A list of strings, one per line.",
    "Raise ValueError if the argument is negative.",
    "for key, value in sorted(items):",
    "This module provides functions for",
    "Return a new path with the suffix changed.",
    "If the iterable is empty,",
    "random.seed(0)",
]
NEW = 48
HOT = 0.7  # a sampling temperature ≠ 1
_INFLIGHT_ATTEMPTS = 3


@dataclass
class Capture:
    dtype: str
    started_s: float
    completions: list[dict[str, Any]] = field(default_factory=list)
    streamed: dict[str, Any] = field(default_factory=dict)
    hot: list[dict[str, Any]] = field(default_factory=list)
    gens: dict[str, Generation] = field(default_factory=dict)
    weights: dict[str, Path] = field(default_factory=dict)
    versions_seen: list[str] = field(default_factory=list)
    inflight_attempts: int = 0


def _complete(
    http: httpx.Client, model: str, prompt: str, seed: int, *, temperature: float = 1.0,
    stream: bool = False,
) -> dict[str, Any]:  # fmt: skip
    body = {
        "model": model, "prompt": prompt, "max_tokens": NEW, "min_tokens": NEW,
        "ignore_eos": True, "temperature": temperature, "seed": seed, "logprobs": 0,
        "return_token_ids": True, "stream": stream,
    }  # fmt: skip
    if not stream:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return {
            "prompt_ids": c["prompt_token_ids"], "ids": c["token_ids"], "text": c["text"],
            "logps": c["logprobs"]["token_logprobs"],
        }  # fmt: skip
    out: dict[str, Any] = {"prompt_ids": None, "ids": [], "text": "", "logps": []}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices") or []:
                out["prompt_ids"] = c.get("prompt_token_ids") or out["prompt_ids"]
                out["ids"] += c.get("token_ids") or []
                out["text"] += c.get("text") or ""
                out["logps"] += (c.get("logprobs") or {}).get("token_logprobs") or []
    return out


def _weights(base: Path, dest: Path, head_scale: float) -> Path:
    """A copy of the model directory whose output layer is scaled: other weights, same shapes."""
    shutil.copytree(base, dest)
    model = llama.load(base)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    llama.save(model, dest)
    return dest


def _generate_streamed_with_reload(
    engine: EngineClient, url: str, prompt: list[int], reload: Callable[[], None]
) -> Generation:
    """A 400-token generation streamed from /inference/v1/generate; once 8 tokens have arrived
    the reading thread pauses the engine at once (in CI a loaded box let the main thread wake
    only after all 400 tokens were out), then ``reload`` runs here while the request waits."""
    body = {
        "model": engine.model, "token_ids": prompt, "stream": True,
        "sampling_params": {
            "max_tokens": 400, "min_tokens": 400, "ignore_eos": True, "seed": 7,
            "logprobs": 0, "detokenize": False,
        },
    }  # fmt: skip
    got: dict[str, Any] = {"ids": [], "logps": [], "spans": None, "error": None}
    started = threading.Event()

    def consume() -> None:
        try:
            with httpx.stream("POST", f"{url}/inference/v1/generate", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for c in json.loads(line[6:]).get("choices") or []:
                        got["ids"] += c.get("token_ids") or []
                        content = (c.get("logprobs") or {}).get("content") or []
                        got["logps"] += [float(x["logprob"]) for x in content]
                        got["spans"] = c.get("weight_versions") or got["spans"]
                    if len(got["ids"]) >= 8 and not started.is_set():
                        engine.pause()
                        started.set()
        except Exception as e:  # reported by the caller's assertion
            got["error"] = repr(e)
        finally:
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(600)
    reload()
    t.join(600)
    assert got["error"] is None, got["error"]
    versions: list[str | None] = [None] * len(got["ids"])
    for span in got["spans"] or []:
        for i in range(int(span["start"]), int(span["end"])):
            versions[i] = str(span["version"])
    return Generation(prompt, got["ids"], got["logps"], versions, "length")


@pytest.fixture(scope="module")
def bf16(engines: Engines, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Capture:
    tmp = tmp_path_factory.mktemp("vllm-bf16")
    s = engines.get("bfloat16", ("--enable-scale-out",))
    try:
        cap = Capture("bfloat16", float(s.started_s or 0))
        with httpx.Client(base_url=s.url, timeout=300) as http:
            cap.completions = [_complete(http, s.model, p, i) for i, p in enumerate(PROMPTS)]
            cap.streamed = _complete(http, s.model, PROMPTS[0], 0, stream=True)
            cap.hot = [
                _complete(http, s.model, p, i, temperature=HOT) for i, p in enumerate(PROMPTS[:4])
            ]
        engine = EngineClient(s.url, s.model)
        try:
            prompt = cap.completions[0]["prompt_ids"]
            cap.weights["1"] = tiny_model
            cap.versions_seen.append(engine.version())
            engine.set_version("1")
            cap.gens["1"] = engine.generate(prompt, NEW, seed=1)
            cap.gens["1-streamed"] = engine.generate(prompt, NEW, seed=1, on_tokens=lambda n: None)
            cap.weights["2"] = _weights(tiny_model, tmp / "v2", 1.3)
            engine.reload(cap.weights["2"], "2")
            cap.versions_seen.append(engine.version())
            cap.gens["2"] = engine.generate(prompt, NEW, seed=1)
            cap.weights["3"] = _weights(tiny_model, tmp / "v3", 0.7)
            for attempt in range(1, _INFLIGHT_ATTEMPTS + 1):
                # A starved reading thread can pause the engine only after it sent all 400
                # tokens (no switch to label): then back to "2" and again, at most 3 times.
                if attempt > 1:
                    engine.reload(cap.weights["2"], "2")
                cap.gens["inflight"] = _generate_streamed_with_reload(
                    engine, s.url, prompt, lambda: engine.reload(cap.weights["3"], "3", paused=True)
                )
                cap.inflight_attempts = attempt
                if "3" in cap.gens["inflight"].versions:
                    break
            cap.versions_seen.append(engine.version())
        finally:
            engine.close()
    finally:
        engines.stop()  # its weights were reloaded: no other test is to meet this server
    return cap


@pytest.fixture(scope="module")
def fp32(engines: Engines) -> Capture:
    s = engines.get("float32", FP32_EXTRA)  # the proxy tests' engine (test_vllm_proxy.py)
    cap = Capture("float32", float(s.started_s or 0))
    with httpx.Client(base_url=s.url, timeout=300) as http:
        cap.completions = [_complete(http, s.model, p, i) for i, p in enumerate(PROMPTS)]
    return cap


@pytest.fixture(scope="module")
def trainer(tiny_model: Path) -> llama.TinyLlama:
    return llama.load(tiny_model).eval()


def _k3(pi: torch.Tensor, mu: list[float]) -> float:
    d = pi.double() - torch.tensor(mu, dtype=torch.float64)
    return float((torch.exp(d) - 1 - d).mean())


def _recompute(model: llama.TinyLlama, prompt: list[int], ids: list[int], t: float = 1.0) -> Any:
    with torch.no_grad():
        return llama.response_logprobs(model, prompt, ids, t)


def test_token_ids_are_the_tokenizers(bf16: Capture, vllm_python: str, tiny_model: Path) -> None:
    """The prompt ids vLLM reports are the model tokenizer's encoding of the prompt text, and
    the sampled ids decode to the text vLLM returned (but for a withheld trailing partial
    character): the trainer can use the ids as given."""
    done = tokenizer_roundtrip(
        vllm_python, tiny_model, PROMPTS, [c["ids"] for c in bf16.completions]
    )
    assert [c["prompt_ids"] for c in bf16.completions] == done["encoded"]
    for c, decoded in zip(bf16.completions, done["decoded"], strict=True):
        # vLLM's incremental detokenizer withholds a trailing incomplete UTF-8 character
        # (byte-level tokens that end mid-character); everything before it is the same text
        assert decoded.startswith(c["text"])
        assert set(decoded[len(c["text"]) :]) <= {"\ufffd"}
    assert all(len(c["ids"]) == NEW == len(c["logps"]) for c in bf16.completions)


def test_streamed_equals_non_streamed(bf16: Capture) -> None:
    """The same seeded request, streamed and not: the same prompt ids, sampled ids, log-probs."""
    plain, streamed = bf16.completions[0], bf16.streamed
    assert streamed["prompt_ids"] == plain["prompt_ids"]
    assert streamed["ids"] == plain["ids"]
    assert streamed["logps"] == plain["logps"]
    assert streamed["text"] == plain["text"]


def test_logprobs_are_raw_whatever_the_temperature(bf16: Capture, trainer: Any) -> None:
    """By default vLLM returns log-probs of softmax(logits), temperature 1, even for a request
    sampled at 0.7: they match the trainer at T = 1 to bf16 precision and miss the trainer at
    T = 0.7 (the log-probs of what was actually sampled) by far more."""
    at_one = at_hot = 0.0
    for c in bf16.hot:
        at_one += _k3(_recompute(trainer, c["prompt_ids"], c["ids"])[0], c["logps"])
        at_hot += _k3(_recompute(trainer, c["prompt_ids"], c["ids"], HOT)[0], c["logps"])
    assert at_one / len(bf16.hot) < 1e-2
    assert at_hot > 20 * at_one


def test_reload_takes_effect_and_labels_tokens(bf16: Capture) -> None:
    """After reload_weights + update_weight_version, the engine samples from the new weights
    (its μ matches the trainer on the new weights, not on the old) and labels each token with
    the version that produced it, including a switch inside a request in flight."""
    assert bf16.versions_seen == ["default", "2", "3"]
    models = {v: llama.load(p).eval() for v, p in bf16.weights.items()}
    g1, g2, hot = bf16.gens["1"], bf16.gens["2"], bf16.gens["inflight"]
    assert g1.versions == ["1"] * NEW and g2.versions == ["2"] * NEW
    assert bf16.gens["1-streamed"] == g1  # the demo's streamed path parses the same answer
    k_new = _k3(_recompute(models["2"], g2.prompt, g2.token_ids)[0], g2.logprobs)
    k_old = _k3(_recompute(models["1"], g2.prompt, g2.token_ids)[0], g2.logprobs)
    assert k_new < 1e-2 and k_old > 10 * k_new
    assert len(hot.token_ids) == 400 == len(hot.logprobs)
    assert "3" in hot.versions, f"no in-flight switch in {bf16.inflight_attempts} attempts"
    switch = hot.versions.index("3")
    assert 8 <= switch < 400
    assert hot.versions == ["2"] * switch + ["3"] * (400 - switch)


Item = tuple[list[int], list[int], list[float]]  # prompt ids, sampled ids, μ


def _report(
    tap: Tap, step: int, model: Any, items: list[Item],
    versions: list[list[int]] | None = None, policy_version: int | None = None,
) -> None:  # fmt: skip
    """One batch: μ from the engine, π and H from the fp32 trainer, ids as the engine gave them."""
    pis, hs = zip(*(_recompute(model, p, ids) for p, ids, _ in items), strict=True)
    lengths = torch.tensor([len(ids) for _, ids, _ in items])
    cu = torch.zeros(len(items) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    ids = torch.tensor([t for _, s, _ in items for t in s], dtype=torch.int64)
    n = int(cu[-1])
    tap.report(
        step, cu_seqlens=cu, logp_rollout=torch.tensor([x for _, _, m in items for x in m]),
        logp_train=torch.cat(pis), entropy=torch.cat(hs), loss_mask=torch.ones(n, dtype=torch.int8),
        token_ids=ids, token_ids_train=ids.clone(), policy_version=policy_version,
        versions=None if versions is None else torch.tensor([v for s in versions for v in s]),
    )  # fmt: skip


def _series(srv: ServerProc, run: str, names: str) -> dict[str, list[Any]]:
    with srv.client() as c:
        r = c.get(f"/v1/runs/{run}/metrics", params={"names": names})
    assert r.status_code == 200, r.text
    return r.json()["series"]  # type: ignore[no-any-return]


def test_history_separates_bf16_from_fp32_and_shows_versions(
    bf16: Capture, fp32: Capture, trainer: Any, server: ServerProc
) -> None:
    """Both engines' batches and the reload run go through the tap into ``timwatch serve``; the
    history shows the bf16 engine's mismatch ≥ 1e4 × the fp32 engine's, no token id mismatch,
    and the reload run's weight versions (lag and a version switch inside a sequence)."""
    runs = {"vllm-bf16": bf16, "vllm-fp32": fp32}
    taps = {run: Tap(server.url, run, rank=0) for run in runs}
    for run, cap in runs.items():
        items = [(c["prompt_ids"], c["ids"], c["logps"]) for c in cap.completions]
        _report(taps[run], 0, trainer, items)
    models = {v: llama.load(p).eval() for v, p in bf16.weights.items()}
    reload_tap = Tap(server.url, "vllm-reload", rank=0)
    for step, key, policy in ((0, "1", 1), (1, "2", 2), (2, "inflight", 3)):
        g = bf16.gens[key]
        versions = [[int(v) for v in g.versions if v is not None]]
        _report(reload_tap, step, models[str(policy)], [(g.prompt, g.token_ids, g.logprobs)],
                versions, policy)  # fmt: skip
    for t in [*taps.values(), reload_tap]:
        assert t.close(60)
        assert t.stats()["dropped"] == 0 and t.stats()["sent"] == t.stats()["reported"]
    names = "mismatch_kl,token_id_mismatch_ratio,tokens"
    b, f = _series(server, "vllm-bf16", names), _series(server, "vllm-fp32", names)
    assert b["tokens"] == f["tokens"] == [len(PROMPTS) * NEW]
    assert b["token_id_mismatch_ratio"] == f["token_id_mismatch_ratio"] == [0.0]
    assert b["mismatch_kl"][0] >= 1e4 * f["mismatch_kl"][0]
    assert 1e-5 < b["mismatch_kl"][0] < 1e-1
    print(
        f"\nvLLM start (--enforce-eager): bf16 {bf16.started_s:.0f} s, fp32 {fp32.started_s:.0f} s;"
        f" mismatch k3: bf16 {b['mismatch_kl'][0]:.3g}, fp32 {f['mismatch_kl'][0]:.3g}"
    )
    r = _series(server, "vllm-reload", "version_lag_max,intra_switch_ratio,policy_version")
    assert r["policy_version"] == [1, 2, 3]
    assert r["version_lag_max"] == [0, 0, 1]
    assert r["intra_switch_ratio"] == [0.0, 0.0, 1.0]
