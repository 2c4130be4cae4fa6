"""The demo engine's settings that the labelled runs use (sidecar/demo/tinylm.py, train.py): the
rotary angles' dtype, the decode KV cache's dtype and the distillation teacher. Each changes
the engine the way the real setting does, and nothing else: with fp32 everywhere the engine's
decode matches the trainer's prefill."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from timwatch.sidecar.demo.tinylm import TinyLM  # noqa: E402
from timwatch.sidecar.demo.train import PROMPT_LEN, DemoTrainer  # noqa: E402

NEW = 48


def _gap(engine: Any, trainer: Any) -> tuple[Any, Any]:
    """Per-position |log μ − log π| of the engine's decode against the trainer's prefill, and
    of the engine's decode against its own prefill, averaged over the batch."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, trainer.vocab, (32, PROMPT_LEN), generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the sampled tokens depend on the reduction order
    try:
        roll = engine.generate(prompt, NEW, gen)
    finally:
        torch.set_num_threads(threads)
    full = torch.cat([prompt, roll.tokens], dim=1)

    def logp(model: Any) -> Any:
        with torch.no_grad():
            lp = torch.log_softmax(model(full)[:, PROMPT_LEN - 1 : -1].float(), dim=-1)
        return lp.gather(-1, roll.tokens[..., None])[..., 0]

    return (logp(trainer) - roll.logp).abs().mean(0), (logp(engine) - roll.logp).abs().mean(0)


def test_rotary_angles_in_bf16_drift_more_the_longer_the_response() -> None:
    trainer = TinyLM(seed=0, max_len=PROMPT_LEN + NEW, rope=True).eval()
    exact = copy.deepcopy(trainer)
    same, _ = _gap(exact, trainer)
    assert float(same.max()) < 1e-4  # fp32 angles in both: only kernel-order differences
    engine = copy.deepcopy(trainer)
    engine.rope_dtype = torch.bfloat16
    drift, own = _gap(engine, trainer)
    first, last = float(drift[: NEW // 4].mean()), float(drift[-NEW // 4 :].mean())
    assert last > 2 * first > 0  # ×2.8 to ×4.3 on seeds 0-2 of this setup
    assert float(own.max()) < 1e-4  # the engine's prefill has the same angles: decode ≈ prefill


def test_an_fp8_kv_cache_changes_decode_only() -> None:
    trainer = TinyLM(seed=0, max_len=PROMPT_LEN + NEW).eval()
    engine = copy.deepcopy(trainer)
    engine.kv_dtype = torch.float8_e4m3fn
    drift, own = _gap(engine, trainer)
    assert float(drift.mean()) > 1e-3
    # the prefill has no cache: the engine's own prefill is the trainer's
    assert torch.allclose(drift, own, atol=1e-6)


class _Tap:
    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []

    def report(self, step: int, **kw: Any) -> None:
        self.batches.append(kw)


def test_an_annealed_teacher_turns_hard_and_stays_above_the_log_prob_floor() -> None:
    common = {"precision": "fp32", "lag": 0, "batch": 4, "max_new_tokens": 8, "updates": 1,
              "lr": 3e-4, "seed": 0, "threads": 1}  # fmt: skip
    tap = _Tap()
    t = DemoTrainer(**common, teacher_decay=0.4)
    for step in range(8):  # 0.4 ** 7 is below the temperature floor
        t.step(step, tap)
    p = [b["logp_teacher"].exp() for b in tap.batches]
    hard = [float(((x < 0.05) | (x > 0.95)).float().mean()) for x in p]
    assert hard[-1] > 0.95 and hard[-1] > hard[0]
    assert min(float(b["logp_teacher"].min()) for b in tap.batches) > -1e5
    plain = _Tap()
    DemoTrainer(**common).step(0, plain)
    assert plain.batches[0]["logp_teacher"] is None
