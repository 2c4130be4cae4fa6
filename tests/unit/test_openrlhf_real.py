"""The OpenRLHF plug-in inside real OpenRLHF 0.11.2 (PyPI, installed by scripts/test.sh with
`--no-deps` plus the packages its imports need, tests/requirements-openrlhf.txt).

The actor update runs through OpenRLHF's own `ActorPPOTrainer.ppo_train` / `training_step`,
replay buffer, `Actor.forward` and `PolicyLoss` on CPU with a tiny Llama;
tests/helpers/openrlhf_tiny.py says what is written here instead (two import-only stand-ins for
CUDA-only `flash_attn` and for `vllm`, the DeepSpeed strategy, the trainer's construction).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_OPENRLHF"):
    import openrlhf  # noqa: F401  # CI installs it: a missing OpenRLHF fails, it does not skip
else:
    pytest.importorskip("openrlhf")

from tests.helpers import openrlhf_tiny as ot
from tests.helpers.frameworks import RaisingTap, RecordingTap
from timwatch.sidecar.integrations import openrlhf as plugin  # noqa: E402
from timwatch.sidecar.integrations.verl_loss import TimwatchTracking  # noqa: E402

# a real trainer package: the full suite and CI run it, the quick tier does not
pytestmark = pytest.mark.framework


@pytest.fixture(scope="module", autouse=True)
def _import_stand_ins() -> Iterator[None]:
    with ot.import_stand_ins():
        yield


@pytest.fixture
def tap(monkeypatch: pytest.MonkeyPatch) -> RecordingTap:
    assert plugin.install()
    ot.cpu_patches(monkeypatch)
    rec = RecordingTap()
    monkeypatch.setattr(plugin, "_COLLECTOR", TimwatchTracking(rec))
    monkeypatch.setattr(plugin, "_ESTR", False)
    return rec


def reported(arrays: dict[str, Any]) -> list[list[tuple[float, float, float]]]:
    cu = [int(x) for x in arrays["cu_seqlens"]]
    cols = [arrays[k].double() for k in ("logp_rollout", "logp_train", "entropy")]
    m = arrays["loss_mask"] != 0
    return [
        [tuple(float(c[j]) for c in cols) for j in range(cu[s], cu[s + 1]) if m[j]]
        for s in range(len(cu) - 1)
    ]


def same_tokens(got: list, want: list, *, with_entropy: bool = True) -> None:
    key = lambda seq: tuple(round(x[1], 4) for x in seq)  # noqa: E731  # OpenRLHF may shuffle
    assert sorted(map(len, got)) == sorted(map(len, want))
    cols = 3 if with_entropy else 2
    for g, w in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        g_t = torch.tensor(g, dtype=torch.float64)[:, :cols]
        w_t = torch.tensor(w, dtype=torch.float64)[:, :cols]
        assert torch.allclose(g_t, w_t, atol=2e-5), (g_t, w_t)


def test_one_report_per_update_with_every_token_once(tap: RecordingTap) -> None:
    model = ot.tiny_llama(0)
    exp, want = ot.experience(1, model, n=4)
    t = ot.trainer(model, ot.args(), micro_batch=4)  # one micro-batch: H before any step
    ot.update(t, exp)
    [(step, arrays)] = tap.reports
    assert step == 1 and arrays["batch_id"] == "openrlhf-s1-r0"
    same_tokens(reported(arrays), want)


def test_micro_batches_and_epochs_report_each_token_once(tap: RecordingTap) -> None:
    model = ot.tiny_llama(0)
    exp, want = ot.experience(2, model, n=6)
    t = ot.trainer(model, ot.args(max_epochs=2), micro_batch=2)  # 3 micro-batches × 2 epochs
    ot.update(t, exp)
    [(_, arrays)] = tap.reports
    same_tokens(reported(arrays), want, with_entropy=False)  # H moves after the first SGD step


def test_steps_follow_openrlhfs_global_step(tap: RecordingTap, tmp_path: Path) -> None:
    model = ot.tiny_llama(0)
    t = ot.trainer(model, ot.args(freezing_steps=2))  # the driver skips steps 1-3's actor
    for i in range(2):
        ot.update(t, ot.experience(10 + i, model)[0])
    (tmp_path / "_actor").mkdir()
    (tmp_path / "_actor" / "latest").write_text("global_step7")  # DeepSpeed's tag file
    resumed = ot.trainer(model, ot.args(ckpt_path=str(tmp_path)))
    ot.update(resumed, ot.experience(20, model)[0])
    assert [s for s, _ in tap.reports] == [4, 5, 8]


def test_estr_zeroes_the_rejected_tokens_advantages(
    tap: RecordingTap, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ESTR in OpenRLHF's loss equals OpenRLHF's loss on a batch whose rejected tokens have
    advantage 0; `estr_mask_ratio` joins OpenRLHF's own metrics."""
    tau = 0.05
    model0 = ot.tiny_llama(0)
    exp, want = ot.experience(3, model0, n=4)
    rejected = [(p - m) ** 2 > tau * (h + 0.01) for seq in want for m, p, h in seq]
    assert 0 < sum(rejected) < len(rejected)
    monkeypatch.setenv("TIMWATCH_ESTR_TAU", str(tau))
    monkeypatch.setattr(plugin, "_ESTR", True)
    masked = ot.tiny_llama(0)
    status = ot.update(ot.trainer(masked, ot.args(), micro_batch=4), exp)
    assert status["estr_mask_ratio"] == pytest.approx(sum(rejected) / len(rejected), abs=1e-6)

    monkeypatch.setattr(plugin, "_ESTR", False)
    exp2, _ = ot.experience(3, ot.tiny_llama(0), n=4)
    d = exp2.action_log_probs.double() - exp2.rollout_log_probs.double()
    h = torch.zeros_like(d)
    for i, seq in enumerate(want):
        h[i, : len(seq)] = torch.tensor([x[2] for x in seq], dtype=torch.float64)
    reject = (d * d > tau * (h + 0.01)) & exp2.action_mask
    exp2.advantages = torch.where(reject, 0.0, exp2.advantages)
    by_hand = ot.tiny_llama(0)
    ot.update(ot.trainer(by_hand, ot.args(), micro_batch=4), exp2)
    for a, b in zip(masked.parameters(), by_hand.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    plain = ot.tiny_llama(0)
    ot.update(ot.trainer(plain, ot.args(), micro_batch=4), ot.experience(3, ot.tiny_llama(0))[0])
    pairs = zip(masked.parameters(), plain.parameters(), strict=True)
    assert any(not torch.allclose(a, b) for a, b in pairs)


def test_a_failing_tap_never_breaks_the_update(
    tap: RecordingTap, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = RaisingTap(OSError("monitor down"))
    monkeypatch.setattr(plugin, "_COLLECTOR", TimwatchTracking(failing))
    model = ot.tiny_llama(0)
    before = [p.detach().clone() for p in model.parameters()]
    ot.update(ot.trainer(model, ot.args(), micro_batch=4), ot.experience(5, model)[0])
    assert failing.calls == 1  # reported, failed, logged
    pairs = zip(model.parameters(), before, strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)  # the update was taken
