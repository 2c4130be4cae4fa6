"""Lab v2's pieces (benchmarks/collapse_lab/v2), fast: the corpus's statistics against its own
definition, the reward on hand-computed responses, the engines' numerics against the fp32
trainer, the lag, and one tiny GRPO step through a recording tap. The lab's runs and their
table are docs/early-warning.md ("Lab v2"); a tiny pretraining config (cached under tmp_path)
keeps this in seconds."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.collapse_lab.v2.configs import CONFIGS
from benchmarks.collapse_lab.v2.corpus import Corpus, CorpusConfig
from benchmarks.collapse_lab.v2.engines import (
    Engine,
    int4_group_round,
    int4_tensor_round,
    processed_logprobs,
)
from benchmarks.collapse_lab.v2.grpo import V2Trainer
from benchmarks.collapse_lab.v2.model import LM, ModelConfig
from benchmarks.collapse_lab.v2.pretrain import PretrainConfig
from benchmarks.collapse_lab.v2.reward import class_fraction, pattern_reward, reward

TINY = PretrainConfig(model=ModelConfig(d=32, layers=1, heads=2), steps=3, batch=4, seq_len=24)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(CorpusConfig())


def test_corpus_is_a_long_tailed_chain(corpus: Corpus) -> None:
    t = corpus.transition
    assert t.shape == (2048, 2048)
    np.testing.assert_allclose(t.sum(1), 1.0, rtol=0, atol=1e-12)
    assert (t > 0).all()  # the backoff gives every id a tail probability after every id
    # entropy rate, recomputed in float64 from the rows under a power-iterated stationary law
    pi = np.full(2048, 1 / 2048)
    for _ in range(300):
        pi = pi @ t
    h = float(pi @ -(t * np.log(t)).sum(1))
    assert math.isclose(corpus.entropy_rate(), h, rel_tol=1e-6)
    assert 1.0 < h < math.log(2048)
    # samples follow the chain: the empirical successor law of the commonest id matches its row
    seqs = corpus.sample(400, 64, np.random.default_rng(0))
    top = int(np.argmax(corpus.unigram))
    prev, nxt = seqs[:, :-1].ravel(), seqs[:, 1:].ravel()
    follow = nxt[prev == top]
    assert len(follow) > 500
    emp = np.bincount(follow, minlength=2048) / len(follow)
    assert 0.5 * np.abs(emp - t[top]).sum() < 0.25  # total variation, n ≈ 10³ samples
    # Zipf-like: the 20 commonest ids carry far more than 20/2048 of the tokens
    counts = np.sort(np.bincount(seqs.ravel(), minlength=2048))[::-1]
    assert counts[:20].sum() / counts.sum() > 0.15


def test_reward_hand_computed() -> None:
    # 40 distinct ids, 16 of them ≡ 0 mod 8: f = 0.4 exactly -> 1
    ids = [8 * i for i in range(1, 17)] + [8 * i + 1 for i in range(1, 25)]
    assert reward(torch.tensor([ids])).item() == pytest.approx(1.0)
    # 40 ids, 8 in class: f = 0.2 -> 1 - 0.2/0.4 = 0.5
    ids = [8 * i for i in range(1, 9)] + [8 * i + 3 for i in range(1, 33)]
    assert reward(torch.tensor([ids])).item() == pytest.approx(0.5)
    # f = 1 -> |1 - .4|/.4 > 1 -> clipped to 0
    assert reward(torch.tensor([[8 * i for i in range(40)]])).item() == 0.0
    # f = 0.4 but 12 distinct ids (< 24): factor 12/24
    row = [16, 24, 32, 40, 48, 56] * 4 + [1, 2, 3, 4, 5, 6] * 6
    assert class_fraction(torch.tensor([row])).item() == pytest.approx(0.4)
    assert reward(torch.tensor([row])).item() == pytest.approx(0.5)


@pytest.mark.parametrize("score", [reward, pattern_reward])
@settings(max_examples=30, deadline=None)
@given(row=st.lists(st.integers(0, 2047), min_size=1, max_size=64))
def test_rewards_are_in_unit_interval(
    score: Callable[[torch.Tensor], torch.Tensor], row: list[int]
) -> None:
    r = score(torch.tensor([row])).item()
    assert 0.0 <= r <= 1.0


def test_pattern_reward_hand_computed() -> None:
    # 32 positions, period 4: class ids (≡ 0 mod 8) at 0, 4, ..., 28 and none elsewhere, 32
    # distinct ids -> 1
    row = [8 * (i + 1) if i % 4 == 0 else 8 * i + 1 for i in range(32)]
    assert pattern_reward(torch.tensor([row])).item() == pytest.approx(1.0)
    # class ids at 4 of the 8 wanted positions and at 6 of the 24 others: 1/2 - 1/4
    cls = {0, 4, 8, 12, 1, 2, 3, 5, 6, 7}
    row = [8 * (i + 1) if i in cls else 8 * i + 1 for i in range(32)]
    assert pattern_reward(torch.tensor([row])).item() == pytest.approx(0.25)
    # the pattern shifted by one: hit 0, miss 8/24 -> clipped to 0; every id in the class: 0
    row = [8 * (i + 1) if i % 4 == 1 else 8 * i + 1 for i in range(32)]
    assert pattern_reward(torch.tensor([row])).item() == 0.0
    assert pattern_reward(torch.tensor([[8 * i for i in range(32)]])).item() == 0.0
    # the pattern held with 8 distinct ids: factor 8/24
    row = [8 if i % 4 == 0 else 8 * (i % 7) + 1 for i in range(32)]
    assert len(set(row)) == 8
    assert pattern_reward(torch.tensor([row])).item() == pytest.approx(8 / 24)


def test_pattern_reward_is_near_zero_for_position_free_ids() -> None:
    # ids drawn independently of their position: hit - miss has mean 0 (float64 reference),
    # so the clipped reward stays small
    tokens = torch.randint(0, 2048, (4000, 64), generator=torch.Generator().manual_seed(0))
    cls = (tokens % 8 == 0).double()
    want = torch.arange(64) % 4 == 0
    diff = cls[:, want].mean(1) - cls[:, ~want].mean(1)
    assert abs(diff.mean().item()) < 0.005
    r = pattern_reward(tokens)
    assert torch.allclose(r.double(), diff.clamp(min=0), atol=1e-6)  # 64 distinct ids or so
    assert r.mean().item() < 0.06


def test_int4_groups_have_at_most_15_levels() -> None:
    w = torch.randn(4, 256)
    q = int4_group_round(w)
    for g in q.reshape(4, 2, 128).reshape(8, 128):
        levels = torch.unique(g)
        assert len(levels) <= 15
        assert g.abs().max() == pytest.approx(float(levels.abs().max()))
    assert (q - w).abs().max() <= w.abs().max() / 14 + 1e-6  # half a step of the widest group


def test_int4_tensor_round_hand_computed() -> None:
    # one scale for the tensor: max |w| / 7 = 0.1, so every entry rounds to a multiple of 0.1
    w = torch.tensor([[0.7, 0.26, -0.04], [0.149, -0.35, 0.0]])
    expected = torch.tensor([[0.7, 0.3, -0.0], [0.1, -0.4, 0.0]])
    torch.testing.assert_close(int4_tensor_round(w), expected)
    q = int4_tensor_round(torch.randn(8, 64))
    assert len(torch.unique(q)) <= 15


def test_processed_logprobs_truncate_and_renormalise() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = processed_logprobs(logits, top_k=3, top_p=0.7)
    # top-3 keeps .5 .3 .15; top-p 0.7 keeps .5 and .3 (0.5 < 0.7, the next starts at 0.8)
    np.testing.assert_allclose(lp.exp()[0].numpy(), [0.625, 0.375, 0.0, 0.0], atol=1e-6)


def _mu_and_pi(kind: str, top_k: int = 0, top_p: float = 1.0) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    lm = LM(ModelConfig())
    eng = Engine(lm, kind, top_k, top_p)
    eng.load(lm.state_dict())
    prompt = torch.randint(0, 2048, (4, 8))
    tokens, mu = eng.generate(prompt, 16, torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = lm(torch.cat([prompt, tokens], 1))[:, 7:-1]
        pi = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    return tokens, mu, pi


def test_engines_differ_from_fp32_as_ordered() -> None:
    _, mu, pi = _mu_and_pi("fp32")
    gap = {"fp32": float((mu - pi).abs().max())}
    assert gap["fp32"] < 1e-4  # decode vs prefill: float order only
    for kind in ("order", "bf16", "fp8", "int4"):
        _, mu, pi = _mu_and_pi(kind)
        gap[kind] = float((mu - pi).abs().max())
    assert 0 < gap["order"] < 1e-4
    assert gap["bf16"] > 1e-3
    assert gap["fp8"] > gap["bf16"] and gap["int4"] > gap["bf16"]
    _, mu, pi = _mu_and_pi("int4t")
    assert float((mu - pi).abs().max()) > gap["int4"]  # one scale per tensor: cruder
    _, mu, pi = _mu_and_pi("bf16", top_k=50, top_p=0.9)
    assert (mu > pi + 0.01).float().mean() > 0.9  # renormalised truncation raises μ


def test_lag_rolls_out_old_weights_and_one_step_runs(tmp_path: Path) -> None:
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[dict[str, Any]] = []

        def report(self, step: int, **kw: Any) -> None:
            self.calls.append({"step": step, **kw})

    cfg = CONFIGS["mini"]  # int4 engine, lag 1
    tr = V2Trainer(cfg, seed=0, pre=TINY, cache=tmp_path)
    assert (tmp_path / f"lm-{TINY.key()}.pt").exists()
    tap = Recorder()
    logs = [tr.step(s, tap) for s in range(3)]
    n = cfg.prompts * cfg.group * cfg.response
    assert [c["step"] for c in tap.calls] == [0, 1, 2]
    assert [int(c["versions"][0]) for c in tap.calls] == [0, 0, 1]  # lag 1
    assert all(len(c["logp_rollout"]) == n and len(c["logp_train"]) == n for c in tap.calls)
    assert sorted(tr.history) == [2, 3]  # only what the lag still needs is kept
    for log in logs:
        assert 0 <= log.reward <= 1 and log.grad_norm > 0 and log.entropy > 1.0
        assert log.mismatch_kl > 0 and log.lr == cfg.lr and log.response_len_max == cfg.response
    # the same seed reproduces the run; the cached pretraining is reused
    tr2 = V2Trainer(cfg, seed=0, pre=TINY, cache=tmp_path)
    assert [tr2.step(s, Recorder()).reward for s in range(3)] == [x.reward for x in logs]
