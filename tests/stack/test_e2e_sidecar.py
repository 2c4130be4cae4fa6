"""End to end on loopback, all real processes: client → proxy → SGLang stand-in; trainer report →
proxy's join → `timwatch serve` → ``/metrics`` and the history API; and the real
``timwatch sidecar sglang`` command with ``--monitor --run --token --probe-rate``, whose prefill
probes land in run ``<run>-prefill-probe``.

SGLang needs a GPU, so the upstream is ``tests/helpers/fake_sglang.py``, which answers in SGLang
0.5.x's wire format (see its docstring for the source it was checked against). Its "model" is
an exact
float64 distribution, which stands in for the trainer's recomputation here: the trainer's π is
that distribution's log-prob plus a known perturbation, so every expected metric is computed
independently from the same numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest

import tests.helpers.fake_sglang as fake
from tests.helpers.procs import ServerProc, free_port, running_process
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.row import derive_row

PROXY = """
import sys, uvicorn
from timwatch.sidecar.proxy.sglang.app import create_app
from timwatch.sidecar.proxy.join.http import install_join
upstream, port, monitor = sys.argv[1], int(sys.argv[2]), sys.argv[3]
app = create_app(upstream, topk=5, vocab_size=48)
install_join(app, monitor=monitor, run="e2e-default", report_ttl_s=5.0)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


@pytest.fixture
def stack(server: ServerProc) -> Iterator[tuple[str, str, ServerProc]]:
    fport, pport = free_port(), free_port()
    upstream = f"http://127.0.0.1:{fport}"
    with running_process(
        ["-m", "tests.helpers.fake_sglang", "--port", str(fport)], f"{upstream}/health"
    ):
        proxy = f"http://127.0.0.1:{pport}"
        args = ["-c", PROXY, upstream, str(pport), server.url]
        with running_process(args, f"{proxy}/timwatch/healthz"):
            yield upstream, proxy, server


def trainer_view(prompt: list[int], ids: list[int]) -> tuple[list[float], list[float], list[float]]:
    """(μ as the engine computed it, the trainer's π, the trainer's exact entropy) per token."""
    mu, pi, ent = [], [], []
    for t, tok in enumerate(ids):
        dist = fake.distribution(prompt + ids[:t])
        mu.append(dist[tok])
        pi.append(min(dist[tok] + 0.02 * math.sin(t + len(prompt)), 0.0))
        ent.append(fake.entropy(dist))
    return mu, pi, ent


def metric_value(exposition: str, name: str, run: str) -> float | None:
    for line in exposition.splitlines():
        if line.startswith(f'{name}{{run="{run}"}} '):
            return float(line.split()[-1])
    return None


def test_generate_report_join_forward_metrics_and_history(
    stack: tuple[str, str, ServerProc],
) -> None:
    upstream, proxy, server = stack
    httpx.post(
        f"{upstream}/update_weight_version", json={"new_version": "step-7"}
    ).raise_for_status()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8], [9, 7]]
    rids = [f"e2e-{i}" for i in range(len(prompts))]
    body: dict[str, Any] = {
        "input_ids": prompts,
        "rid": rids,
        "sampling_params": {"max_new_tokens": 9, "temperature": 1.0},
    }
    answer = httpx.post(f"{proxy}/generate", json=body, timeout=30).json()
    assert [a["meta_info"]["id"] for a in answer] == rids
    assert all("output_token_logprobs" not in a["meta_info"] for a in answer)  # client unchanged

    samples, mu_all, pi_all, ent_all, ids_all, train_ids_all = [], [], [], [], [], []
    cu = [0]
    for prompt, rid, out in zip(prompts, rids, answer, strict=True):
        ids = list(out["output_ids"])
        mu, pi, ent = trainer_view(prompt, ids)
        train_ids = list(ids)
        if rid == "e2e-1":
            train_ids[2] = (train_ids[2] + 1) % fake.VOCAB  # the trainer re-tokenised differently
        samples.append({"rid": rid, "token_ids": train_ids, "logp_train": pi, "entropy": ent})
        mu_all += mu
        pi_all += pi
        ent_all += ent
        ids_all += ids
        train_ids_all += train_ids
        cu.append(cu[-1] + len(ids))
    report = {"run": "e2e", "step": 3, "policy_version": 8, "samples": samples}
    got = httpx.post(f"{proxy}/timwatch/v1/trainer_reports", json=report, timeout=30)
    assert got.status_code == 200, got.text
    assert got.json()["status"] == "forwarded" and got.json()["tokens"] == cu[-1]

    n = cu[-1]
    with server.client() as c:
        deadline = time.monotonic() + 30
        while c.get("/v1/runs/e2e/metrics").status_code != 200:
            assert time.monotonic() < deadline, httpx.get(f"{proxy}/timwatch/v1/join").json()
            time.sleep(0.1)
        names = "tokens,mismatch_kl,token_id_mismatch_ratio,version_lag_max,entropy_mean"
        hist = c.get("/v1/runs/e2e/metrics", params={"names": names}).json()
        exposition = c.get("/metrics").text

    expected = derive_row(accumulate(
        Batch.from_arrays(
            cu_seqlens=np.array(cu), logp_rollout=np.array(mu_all), logp_train=np.array(pi_all),
            entropy=np.array(ent_all), loss_mask=np.ones(n, np.uint8),
            token_ids=np.array(ids_all), token_ids_train=np.array(train_ids_all),
            versions=np.full(n, 7), policy_version=8, step=3,
        )
    )).to_dict()  # fmt: skip
    series = hist["series"]
    assert hist["steps"] == [3]
    assert series["tokens"] == [n]
    assert series["token_id_mismatch_ratio"] == [pytest.approx(1 / n)]
    assert series["token_id_mismatch_ratio"][0] > 0
    assert series["version_lag_max"] == [1]
    assert series["mismatch_kl"][0] == pytest.approx(expected["mismatch_kl"], rel=1e-9)
    assert series["mismatch_kl"][0] > 0
    assert series["entropy_mean"][0] == pytest.approx(expected["entropy_mean"], rel=1e-12)

    assert metric_value(exposition, "timwatch_tokens_total", "e2e") == n
    assert metric_value(exposition, "timwatch_token_id_mismatch_ratio", "e2e") == pytest.approx(
        1 / n
    )
    stats = httpx.get(f"{proxy}/timwatch/v1/join").json()
    assert stats["join"]["joined_samples"] == 4 and stats["join"]["forwarded_batches"] == 1
    assert stats["taps"]["e2e"]["sent"] == 1
    assert stats["capture"]["popped"] == 4


def test_report_for_uncaptured_sample_waits_then_expires_and_is_counted(
    stack: tuple[str, str, ServerProc],
) -> None:
    _, proxy, server = stack
    answer = httpx.post(
        f"{proxy}/generate",
        json={"input_ids": [4, 4, 4], "rid": "kept", "sampling_params": {"max_new_tokens": 5}},
        timeout=30,
    ).json()
    ids = answer["output_ids"]
    mu, pi, ent = trainer_view([4, 4, 4], ids)
    bad = {"run": "e2e-exp", "step": 1, "samples": [{"rid": "kept", "logp_train": "x"}]}
    refused = httpx.post(f"{proxy}/timwatch/v1/trainer_reports", json=bad)
    assert refused.status_code == 422 and refused.json()["field"] == "samples[0].logp_train"
    report = {
        "run": "e2e-exp",
        "step": 1,
        "samples": [
            {"rid": "kept", "logp_train": pi, "entropy": ent},
            {"rid": "never-generated", "logp_train": [-0.5], "entropy": [0.1]},
        ],
    }
    got = httpx.post(f"{proxy}/timwatch/v1/trainer_reports", json=report).json()
    assert got["status"] == "pending" and got["missing"] == ["never-generated"]
    with server.client() as c:
        deadline = time.monotonic() + 30
        while c.get("/v1/runs/e2e-exp/metrics").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        hist = c.get("/v1/runs/e2e-exp/metrics", params={"names": "tokens"}).json()
    assert hist["series"]["tokens"] == [len(ids)]
    stats = httpx.get(f"{proxy}/timwatch/v1/join").json()["join"]
    assert stats["expired_reports"] == 1 and stats["unjoined_samples"] == 1


# ---------------------------------------------------------------- the real CLI command

TOKEN = "e2e-write-token"


@pytest.fixture
def cli_stack(
    server_factory: Callable[..., ServerProc],
) -> Iterator[tuple[str, str, ServerProc]]:
    """``python -m timwatch.cli sidecar sglang`` in front of the stand-in, feeding a monitor that
    refuses writes without its token (so the batches prove ``--token`` reached both taps)."""
    server = server_factory(env={"TIMWATCH_TOKEN": TOKEN}, token=TOKEN)
    fport, pport = free_port(), free_port()
    upstream = f"http://127.0.0.1:{fport}"
    with running_process(
        ["-m", "tests.helpers.fake_sglang", "--port", str(fport)], f"{upstream}/health"
    ):
        proxy = f"http://127.0.0.1:{pport}"
        args = [
            "-m", "timwatch", "sidecar", "sglang",
            "--upstream", upstream, "--listen", f"127.0.0.1:{pport}",
            "--monitor", server.url, "--run", "cli", "--token", TOKEN,
            "--topk", "5", "--probe-rate", "1", "--probe-batch", "4", "--probe-flush", "600",
        ]  # fmt: skip
        with running_process(args, f"{proxy}/timwatch/healthz"):
            yield upstream, proxy, server


def wait_for_step(c: httpx.Client, run: str, step: int, proxy: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        got = c.get(f"/v1/runs/{run}/steps/{step}")
        if got.status_code == 200:
            return dict(got.json())
        if time.monotonic() > deadline:
            probes = httpx.get(f"{proxy}/timwatch/probes").json()
            state = {k: probes[k] for k in ("counters", "forward")}
            pytest.fail(f"{run} step {step} never arrived; proxy probes: {state}")
        time.sleep(0.1)


def probe_expectation(
    prompts: list[list[int]], outputs: list[list[int]], topk: int
) -> tuple[int, float, float]:
    """(tokens, mismatch KL, mean top-k entropy lower bound) of the probe batch, in float64 from
    the stand-in's decode and prefill distributions."""
    k3, bound = [], []
    for prompt, ids in zip(prompts, outputs, strict=True):
        for t, tok in enumerate(ids):
            prefix = prompt + ids[:t]
            pre = np.array(fake.prefill_distribution(prefix))
            delta = pre[tok] - fake.distribution(prefix)[tok]
            k3.append(math.expm1(delta) - delta)
            probs = np.sort(np.exp(pre))[::-1][:topk]
            head = -np.sum(probs * np.log(probs))
            bound.append(head + (1.0 - probs.sum()) * -math.log(probs[-1]))
    return len(k3), float(np.mean(k3)), float(np.mean(bound))


def test_cli_sidecar_joins_reports_and_forwards_prefill_probes(
    cli_stack: tuple[str, str, ServerProc],
) -> None:
    upstream, proxy, server = cli_stack
    httpx.post(
        f"{upstream}/update_weight_version", json={"new_version": "step-7"}
    ).raise_for_status()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8], [9, 7]]
    rids = [f"cli-{i}" for i in range(len(prompts))]
    body = {"input_ids": prompts, "rid": rids, "sampling_params": {"max_new_tokens": 9}}
    answer = httpx.post(f"{proxy}/generate", json=body, timeout=30).json()
    outputs = [list(a["output_ids"]) for a in answer]

    # The trainer's report: no "run" key, so it goes to --run.
    samples, k3 = [], []
    for prompt, rid, ids in zip(prompts, rids, outputs, strict=True):
        mu, pi, ent = trainer_view(prompt, ids)
        samples.append({"rid": rid, "token_ids": ids, "logp_train": pi, "entropy": ent})
        k3 += [math.expm1(p - m) - (p - m) for m, p in zip(mu, pi, strict=True)]
    got = httpx.post(
        f"{proxy}/timwatch/v1/trainer_reports", json={"step": 5, "samples": samples}, timeout=30
    )
    assert got.status_code == 200 and got.json()["status"] == "forwarded", got.text

    with server.client() as c:
        row = wait_for_step(c, "cli", 5, proxy)["row"]
        assert row["tokens"] == len(k3)
        assert row["mismatch_kl"] == pytest.approx(float(np.mean(k3)), rel=1e-9)
        assert row["entropy_source"] == "trainer"

        # Probes: every sample re-scored at the decode's version (step-7 → step 7, lag 0).
        n, kl, ent = probe_expectation(prompts, outputs, topk=5)
        probe = wait_for_step(c, "cli-prefill-probe", 7, proxy)
        assert probe["batches"] == 1
        row = probe["row"]
        assert row["tokens"] == n and row["sequences"] == len(prompts)
        assert row["mismatch_kl"] == pytest.approx(kl, rel=1e-9)
        assert row["mismatch_kl"] > 0
        assert row["entropy_mean"] == pytest.approx(ent, rel=1e-9)
        assert row["entropy_source"] == "topk"
        assert row["version_lag_max"] == 0

        # Weights change in the middle of the next rollout: its probe runs at step-8 and the
        # decode tokens before the switch show up as lag 1 instead of being dropped.
        httpx.post(f"{upstream}/fake/config", json={"switch_at": 2, "next_version": "step-8"})
        prompts2 = [[2, 7, 1, 8], [1, 4, 1], [6, 6, 2], [3, 3]]
        body = {"input_ids": prompts2, "sampling_params": {"max_new_tokens": 9}}
        answer = httpx.post(f"{proxy}/generate", json=body, timeout=30).json()
        outputs2 = [list(a["output_ids"]) for a in answer]
        spans = answer[0]["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == ["step-7", "step-8"]  # the switch happened
        probe = wait_for_step(c, "cli-prefill-probe", 8, proxy)
        n2, kl2, _ = probe_expectation(prompts2, outputs2, topk=5)
        row = probe["row"]
        assert row["tokens"] == n2
        assert row["mismatch_kl"] == pytest.approx(kl2, rel=1e-9)
        assert row["version_lag_max"] == 1
        assert row["version_lag_mean"] == pytest.approx(2 / n2, rel=1e-12)
        hist = c.get(
            "/v1/runs/cli-prefill-probe/metrics", params={"names": "mismatch_kl,tokens"}
        ).json()
        assert hist["steps"] == [7, 8] and hist["series"]["tokens"] == [n, n2]

    fwd = httpx.get(f"{proxy}/timwatch/probes").json()["forward"]
    assert fwd["sequences"] == 8 and fwd["stale_sequences"] == 1 and fwd["batches"] == 2
    assert fwd["tap"]["sent"] == 2 and fwd["tap"]["refused"] == 0
