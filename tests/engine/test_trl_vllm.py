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
of the same tokens; the engine's precision (bf16 mismatch ≥ 100 × fp32's).
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
from tests.helpers.reference import reference
from tests.helpers.trl_run import NEW, PER_STEP, LogCapture, RecordingTap, train
from tests.helpers.vllm import FP32_EXTRA, Engines
from tests.helpers.wire import fresh_run
from timwatch.sidecar.demo.vllm_engine import EngineClient

pytestmark = pytest.mark.timeout(1800)  # two vLLM starts on a busy 2-core machine

STEPS = 3
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


@pytest.fixture(scope="module")
def runs(
    engines: Engines, tiny_model: Path, _shared_server_session: ServerProc,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Run]]:  # fmt: skip
    srv = _shared_server_session
    out: dict[str, Run] = {}
    for dtype, extra in (("bfloat16", ("--enable-scale-out",)), ("float32", FP32_EXTRA)):
        engine = engines.get(dtype, extra)
        client = EngineClient(engine.url, engine.model)
        run = fresh_run(f"trl-vllm-{dtype}")
        tap = RecordingTap(srv.url, run, SHARED_TOKEN, rank=0)
        try:
            trainer, logs = train(
                tiny_model, tap, tmp_path_factory.mktemp(f"trl-{dtype}"), steps=STEPS,
                engine=client,
            )  # fmt: skip
        finally:
            client.close()
        assert tap.close(60)
        with srv.client() as c:
            res = c.get(f"/v1/runs/{run}/metrics", params={"names": NAMES}).json()
        out[dtype] = Run(
            run, res["series"], res["steps"], tap, logs, trainer.timwatch_rollout.answers,
            trainer.vllm_generation.pushed,
        )  # fmt: skip
    yield out


def test_every_step_is_stored_once_with_vllms_mu(runs: dict[str, Run]) -> None:
    for dtype, r in runs.items():
        steps = list(range(1, STEPS + 1))
        assert r.steps == steps == sorted(r.logs.logs), dtype
        assert r.pushed == [0, 1, 2]  # weights pushed before each step's generation
        stats = r.tap.stats()
        assert (stats["reported"], stats["sent"], stats["dropped"]) == (STEPS, STEPS, 0)
        assert r.series["tokens"] == [PER_STEP * NEW] * STEPS  # exactly NEW per completion
        assert r.series["sequences"] == [PER_STEP] * STEPS
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
    bf16 = float(np.mean(runs["bfloat16"].series["mismatch_kl"]))
    fp32 = float(np.mean(runs["float32"].series["mismatch_kl"]))
    print(f"\nTRL on vLLM: mismatch k3 per token, bf16 engine {bf16:.3g}, fp32 engine {fp32:.3g}")
    assert bf16 > 0 and bf16 >= 100 * fp32
