"""A real TRL `GRPOTrainer` (trl 1.16.0) sampling on the real vLLM CPU build, reporting through
`TimwatchGRPOTrainer` to a real ``timwatch serve``: once on a bf16 engine, once on an fp32
engine, the same run shape (tiny Llama, fp32 trainer, `STEPS` steps of 8 completions of 8
tokens).

Generation is `GRPOTrainer`'s ``rollout_func`` calling the vLLM server over HTTP, with the
trainer's weights pushed before each step by save + ``reload_weights`` (`tests.helpers.trl_run`:
TRL's own server mode syncs weights over NCCL, which the CPU build lacks). TRL then runs its
real vLLM code path: old log-probs, the importance-sampling correction, the ``sampling/*`` logs.

What could fail: a step missing or doubled; a μ that is not vLLM's (the stored ``rollout_log_ppl``
against vLLM's own answers, in float64); TRL's logged ``sampling/*`` against the stored metrics
of the same tokens; the engine's precision (bf16 mismatch ≥ 100 × fp32's); ESTR in TRL's loss
(a third run on the bf16 engine with ``estr_tau``) dropping other tokens than the reference's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_TRL"):
    import trl  # noqa: F401  # CI installs it: a missing trl fails, it does not skip
else:
    pytest.importorskip("trl")

from tests.helpers.procs import SHARED_TOKEN, ServerProc
from tests.helpers.reference import RefParams, keep_token, reference
from tests.helpers.trl_run import NEW, PER_STEP, LogCapture, RecordingTap, train
from tests.helpers.vllm import FP32_EXTRA, Engines
from tests.helpers.wire import fresh_run
from timwatch.sidecar.demo.vllm_engine import EngineClient

pytestmark = pytest.mark.timeout(1800)  # two vLLM starts on a busy 2-core machine

STEPS = 3
ESTR_STEPS = 2
#: small enough that ESTR rejects some of the bf16 engine's tokens (δ² > τ(H + ε), H ≈ 4.5)
ESTR_TAU = 2e-4
NAMES = (
    "tokens,sequences,mismatch_kl,rollout_log_ppl,training_log_ppl,log_ratio_abs_mean,"
    "log_ratio_abs_max,is_ratio_min,is_ratio_mean,is_ratio_max"
)
#: TRL's sampling/* names → timwatch's metric of the same tokens
SAME = {
    "sampling/sampling_logp_difference/mean": "log_ratio_abs_mean",
    "sampling/sampling_logp_difference/max": "log_ratio_abs_max",
    "sampling/importance_sampling_ratio/min": "is_ratio_min",
    "sampling/importance_sampling_ratio/mean": "is_ratio_mean",
    "sampling/importance_sampling_ratio/max": "is_ratio_max",
}


@dataclass
class Run:
    run: str
    series: dict[str, list[Any]]
    steps: list[int]
    tap: RecordingTap
    logs: LogCapture
    answers: list[list[list[float]]]  # vLLM's μ per generation call, per completion
    pushed: list[int]
    loss_rows: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]


@pytest.fixture(scope="module")
def runs(
    engines: Engines, tiny_model: Path, _shared_server_session: ServerProc,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Run]]:  # fmt: skip
    srv = _shared_server_session
    out: dict[str, Run] = {}
    plan = (  # fp32 first: the server the proxy tests (run before this module) left running
        ("float32", FP32_EXTRA, STEPS, None),
        ("bfloat16", ("--enable-scale-out",), STEPS, None),
        ("estr", ("--enable-scale-out",), ESTR_STEPS, ESTR_TAU),  # the same bf16 server
    )
    for name, extra, steps, tau in plan:
        engine = engines.get("float32" if name == "float32" else "bfloat16", extra)
        client = EngineClient(engine.url, engine.model)
        run = fresh_run(f"trl-vllm-{name}")
        tap = RecordingTap(srv.url, run, SHARED_TOKEN, rank=0)
        try:
            trainer, logs = train(
                tiny_model, tap, tmp_path_factory.mktemp(f"trl-{name}"), steps=steps,
                engine=client, estr_tau=tau,
            )  # fmt: skip
        finally:
            client.close()
        assert tap.close(60)
        with srv.client() as c:
            res = c.get(f"/v1/runs/{run}/metrics", params={"names": NAMES}).json()
        out[name] = Run(
            run, res["series"], res["steps"], tap, logs, trainer.timwatch_rollout.answers,
            trainer.vllm_generation.pushed, trainer.loss_rows,
        )  # fmt: skip
    yield out


def test_every_step_is_stored_once_with_vllms_mu(runs: dict[str, Run]) -> None:
    for dtype, r in runs.items():
        n = len(r.loss_rows)
        steps = list(range(1, n + 1))
        assert r.steps == steps == sorted(r.logs.logs), dtype
        assert r.pushed == list(range(n))  # weights pushed before each step's generation
        stats = r.tap.stats()
        # a batch and TRL's logs (forwarded by the callback) per step
        assert (stats["reported"], stats["sent"], stats["dropped"]) == (2 * n, 2 * n, 0)
        assert r.series["tokens"] == [PER_STEP * NEW] * n  # exactly NEW per completion
        assert r.series["sequences"] == [PER_STEP] * n
        for i, step in enumerate(steps):
            # μ is vLLM's: rollout_log_ppl of vLLM's own answers for that step, in float64
            # (TRL shuffles nothing before generation; the mean over sequences is order-free)
            vllm = np.mean([-np.mean(np.asarray(s, dtype=np.float64)) for s in r.answers[i]])
            assert r.series["rollout_log_ppl"][i] == pytest.approx(vllm, rel=1e-6), (dtype, step)
            want, _ = reference(r.tap.sent[step])
            for name in ("mismatch_kl", "rollout_log_ppl", "training_log_ppl"):
                assert r.series[name][i] == pytest.approx(want[name], rel=1e-9, abs=1e-15), name


def test_trls_sampling_logs_equal_ours_on_the_same_tokens(runs: dict[str, Run]) -> None:
    """TRL computes them in float32 from the same π_old and μ tensors: equal to timwatch's
    float64 metrics within float32 rounding (rel 1e-5, abs 2e-6)."""
    for dtype, r in runs.items():
        for i, step in enumerate(r.steps):
            logs = r.logs.logs[step]
            for theirs, ours in SAME.items():
                assert logs[theirs] == pytest.approx(r.series[ours][i], rel=1e-5, abs=2e-6), (
                    dtype, step, theirs,
                )  # fmt: skip


def test_bf16_engine_mismatch_is_at_least_100x_fp32s(runs: dict[str, Run]) -> None:
    """The same run shape (`STEPS` steps, same seeds) on a bf16 and an fp32 engine."""
    bf16 = float(np.mean(runs["bfloat16"].series["mismatch_kl"]))
    fp32 = float(np.mean(runs["float32"].series["mismatch_kl"]))
    print(f"\nTRL on vLLM: mismatch k3 per token, bf16 engine {bf16:.3g}, fp32 engine {fp32:.3g}")
    assert bf16 > 0 and bf16 >= 100 * fp32


def test_estr_takes_rejected_tokens_out_of_trls_loss(runs: dict[str, Run]) -> None:
    """With ``estr_tau``, the mask TRL's loss multiplies in drops exactly the tokens that the
    float64 reference rejects (δ² > τ(H + ε) on the reported μ, π, H), row by row; without it
    TRL's loss keeps every token."""
    r = runs["estr"]
    rejected = 0
    for step, sent in r.tap.sent.items():
        cu = sent["cu_seqlens"]
        want = []
        for s in range(len(cu) - 1):
            a, b = int(cu[s]), int(cu[s + 1])
            keep = [
                int(keep_token("estr", lt, lr, h, RefParams(tau=ESTR_TAU)))
                for lt, lr, h in zip(
                    sent["logp_train"][a:b], sent["logp_rollout"][a:b], sent["entropy"][a:b],
                    strict=True,
                )
            ]  # fmt: skip
            want.append((tuple(int(x) for x in sent["token_ids"][a:b]), tuple(keep)))
            rejected += NEW - sum(keep)
        assert sorted(r.loss_rows[step]) == sorted(want), step  # TRL shuffles rows, not tokens
    assert 0 < rejected < ESTR_STEPS * PER_STEP * NEW  # some rejected, not all
    for name in ("bfloat16", "float32"):
        assert all(all(m) for rows in runs[name].loss_rows.values() for _, m in rows)
    print(f"\nESTR tau={ESTR_TAU}: {rejected} of {ESTR_STEPS * PER_STEP * NEW} tokens rejected")
