"""ESTR PPO loss, decoupled ratios and the EWMA old policy against independent float64
references written here with numpy, hand-computed cases and hypothesis properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from timwatch.monitor.trainer.losses import (
    EwmaOldPolicy,
    decoupled_ppo_loss,
    decoupled_ratios,
    estr_ppo_loss,
    k3,
)


def ref_ppo(lp, old, adv, mask, keep=None, low=0.2, high=0.28):
    """Plain asymmetric PPO-clip, token-mean over mask, written per token in float64."""
    lp, old, adv = (np.asarray(a, dtype=np.float64) for a in (lp, old, adv))
    mask = np.asarray(mask, dtype=bool)
    keep = mask if keep is None else (mask & np.asarray(keep, dtype=bool))
    total = 0.0
    for t in range(lp.size):
        if not keep.flat[t]:
            continue
        rho = math.exp(min(max(lp.flat[t] - old.flat[t], -20.0), 20.0))
        a = adv.flat[t]
        total += -min(rho * a, min(max(rho, 1 - low), 1 + high) * a)
    return total / max(int(mask.sum()), 1)


def ref_estr_keep(old, mu, h, tau=1.6, eps=0.01):
    d = np.asarray(old, np.float64) - np.asarray(mu, np.float64)
    return d * d <= tau * (np.asarray(h, np.float64) + eps)


def ref_k3(d):
    d = np.clip(np.asarray(d, np.float64), -20, 20)
    return np.expm1(d) - d


def random_inputs(seed: int, shape: tuple[int, ...], spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    old = (lp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.2).clamp(max=0)
    mu = (old + torch.randn(shape, generator=g, dtype=torch.float64) * spread).clamp(max=0)
    h = torch.rand(shape, generator=g, dtype=torch.float64) ** 3 * 2
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) > 0.25
    return lp, old, mu, h, adv, mask


def test_hand_computed_two_tokens() -> None:
    # token 0: ρ = e^{0.5} ≈ 1.6487 > 1.28, A = 1 -> clipped: -1.28; kept (δ = 0.1, H = 1)
    # token 1: ρ = 1, A = -2 -> +2; rejected by ESTR (δ² = 1 > 1.6 · 0.02)
    # token 2: prompt token (mask 0), anything
    lp = torch.tensor([-0.5, -1.0, -3.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    mu = torch.tensor([-1.1, -2.0, -9.0], dtype=torch.float64)
    h = torch.tensor([1.0, 0.01, 0.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 5.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 0])
    loss, m = estr_ppo_loss(lp, old, adv, mask, mu, h)
    assert loss.item() == pytest.approx(-1.28 / 2, abs=1e-12)
    assert m["estr_mask_ratio"].item() == pytest.approx(0.5)
    assert m["response_tokens"].item() == 2
    expected_kl = ((math.exp(0.1) - 1 - 0.1) + (math.exp(1.0) - 1 - 1.0)) / 2
    assert m["mismatch_kl"].item() == pytest.approx(expected_kl, rel=1e-12)
    loss.backward()
    assert lp.grad is not None and lp.grad.tolist() == [0.0, 0.0, 0.0]  # clipped, rejected, prompt
    plain, _ = estr_ppo_loss(lp, old, adv, mask, None, None, use_mask=False)
    assert plain.item() == pytest.approx((-1.28 + 2.0) / 2, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 5),
    cols=st.integers(1, 30),
    tau=st.floats(0.05, 5.0),
    spread=st.floats(0.0, 3.0),
)
def test_estr_loss_matches_reference_and_gradient_zero_where_masked(
    seed: int, rows: int, cols: int, tau: float, spread: float
) -> None:
    lp, old, mu, h, adv, mask = random_inputs(seed, (rows, cols), spread)
    lp = lp.requires_grad_()
    loss, m = estr_ppo_loss(lp, old, adv, mask, mu, h, tau=tau)
    keep = ref_estr_keep(old, mu, h, tau=tau)
    assert loss.item() == pytest.approx(ref_ppo(lp.detach(), old, adv, mask, keep), abs=1e-10)
    n = max(int(mask.sum()), 1)
    assert m["estr_mask_ratio"].item() == pytest.approx((mask.numpy() & ~keep).sum() / n)
    d = (old - mu).numpy()
    assert m["mismatch_kl"].item() == pytest.approx(ref_k3(d)[mask.numpy()].sum() / n, rel=1e-9)
    loss.backward()
    assert lp.grad is not None
    dropped = ~(mask.numpy() & keep)
    assert np.all(lp.grad.numpy()[dropped] == 0.0)
    # where kept and unclipped the gradient is -ρA/N exactly
    rho = np.exp(np.clip((lp.detach() - old).numpy(), -20, 20))
    a = adv.numpy()
    clipped = np.where(a >= 0, rho > 1.28, rho < 0.8)
    live = ~dropped & ~clipped
    np.testing.assert_allclose(lp.grad.numpy()[live], (-rho * a / n)[live], rtol=1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 64))
def test_unmasked_reduces_to_plain_ppo_clip(seed: int, n: int) -> None:
    lp, old, mu, h, adv, mask = random_inputs(seed, (n,), 2.0)
    plain, _ = estr_ppo_loss(lp, old, adv, mask, mu, h, use_mask=False)
    assert plain.item() == pytest.approx(ref_ppo(lp, old, adv, mask), abs=1e-10)
    # a mask that keeps every token (huge entropy) gives the same loss and gradient
    x1 = lp.clone().requires_grad_()
    x2 = lp.clone().requires_grad_()
    all_kept, m = estr_ppo_loss(x1, old, adv, mask, mu, torch.full_like(h, 1e6))
    no_mask, _ = estr_ppo_loss(x2, old, adv, mask, None, None, use_mask=False)
    assert m["estr_mask_ratio"].item() == 0.0
    assert all_kept.item() == no_mask.item()
    all_kept.backward()
    no_mask.backward()
    assert x1.grad is not None and x2.grad is not None
    assert torch.equal(x1.grad, x2.grad)


def test_bf16_inputs_and_mask_source() -> None:
    lp, old, mu, h, adv, mask = random_inputs(7, (4, 16), 1.0)
    loss, m = estr_ppo_loss(lp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask, mu.float(), h)
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    # bypass mode: old_log_prob is μ itself, the mask must then look at log_prob
    _, bypass = estr_ppo_loss(lp, mu, adv, mask, mu, h, mask_log_prob=lp.detach())
    keep = ref_estr_keep(lp, mu, h)
    n = int(mask.sum())
    assert bypass["estr_mask_ratio"].item() == pytest.approx((mask.numpy() & ~keep).sum() / n)


def test_bad_shapes_and_missing_inputs_are_named() -> None:
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="rollout_log_prob has shape"):
        estr_ppo_loss(x, x, x, x, torch.zeros(4), x)
    with pytest.raises(ValueError, match="needs rollout_log_prob"):
        estr_ppo_loss(x, x, x, torch.ones(3), None, x)
    with pytest.raises(ValueError, match="discrepancy_bound"):
        decoupled_ratios(x, x, x, x, discrepancy_bound=1.0)


def test_k3_is_exact_for_tiny_deltas() -> None:
    d = torch.tensor([1e-4, -1e-4, 0.0, 50.0], dtype=torch.float32)
    out = k3(d)
    assert out.dtype == torch.float64
    assert out[0].item() == pytest.approx(1e-8 / 2 + 1e-12 / 6, rel=1e-6)
    assert out[1].item() == pytest.approx(1e-8 / 2 - 1e-12 / 6, rel=1e-6)
    assert out[2].item() == 0.0
    assert out[3].item() == pytest.approx(math.expm1(20.0) - 20.0)


def test_decoupled_ratios_hand_case() -> None:
    lp = torch.tensor([-1.0, -1.0, -2.0])
    old = torch.tensor([-1.5, -1.0, -2.0])
    mu = torch.tensor([-1.5, -2.0, -2.5])
    mask = torch.tensor([1, 1, 0])
    r = decoupled_ratios(lp, old, mu, mask)
    assert r.discrepancy_ratio.tolist() == pytest.approx([1.0, math.e, math.exp(0.5)], rel=1e-6)
    assert r.discrepancy_keep.tolist() == [True, False, True]  # e > 2
    assert r.staleness_ratio.tolist() == pytest.approx([math.exp(0.5), 1.0, 1.0], rel=1e-6)
    assert r.staleness_clipped.tolist() == pytest.approx([1.28, 1.0, 1.0], rel=1e-6)
    assert r.staleness_clip_active.tolist() == [True, False, False]
    assert r.metrics["discrepancy_kl"].item() == pytest.approx((math.e - 2) / 2, rel=1e-6)
    assert r.metrics["staleness_kl"].item() == pytest.approx((math.exp(0.5) - 1.5) / 2, rel=1e-6)
    assert r.metrics["discrepancy_mask_ratio"].item() == pytest.approx(0.5)
    assert r.metrics["staleness_clipfrac"].item() == pytest.approx(0.5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 50), bound=st.floats(1.01, 10.0))
def test_decoupled_mask_is_symmetric_and_loss_matches_reference(
    seed: int, n: int, bound: float
) -> None:
    lp, old, mu, _, adv, mask = random_inputs(seed, (n,), 1.0)
    a = decoupled_ratios(lp, old, mu, mask, discrepancy_bound=bound)
    b = decoupled_ratios(lp, mu, old, mask, discrepancy_bound=bound)
    assert torch.equal(a.discrepancy_keep, b.discrepancy_keep)
    x = lp.clone().requires_grad_()
    loss, metrics = decoupled_ppo_loss(x, old, mu, adv, mask, discrepancy_bound=bound)
    o, m_, l_, ad = old.numpy(), mu.numpy(), lp.numpy(), adv.numpy()
    w = np.exp(o - m_)
    keep = mask.numpy() & (np.abs(o - m_) <= math.log(bound))
    s = np.exp(l_ - o)
    per = np.maximum(-ad * s, -ad * np.clip(s, 0.8, 1.28))
    expected = (per * w)[keep].sum() / max(int(mask.sum()), 1)
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    loss.backward()
    assert x.grad is not None and np.all(x.grad.numpy()[~keep] == 0.0)
    assert metrics["staleness_kl"].item() == pytest.approx(
        ref_k3(l_ - o)[mask.numpy()].sum() / max(int(mask.sum()), 1), rel=1e-9, abs=1e-15
    )


def test_ewma_old_policy() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ewma = EwmaOldPolicy(model, window=4)
    assert ewma.beta == pytest.approx(4 / 6)
    w0 = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ewma.update()
    expected = (4 / 6) * w0 + (2 / 6) * (w0 + 1.0)
    torch.testing.assert_close(ewma.shadow_parameters()[0], expected)
    x = torch.randn(2, 4)
    current = model(x).detach()
    with ewma.applied() as m:
        under_shadow = m(x).detach()
    torch.testing.assert_close(under_shadow, x @ expected.T + model.bias.detach())
    torch.testing.assert_close(model(x).detach(), current)  # restored
    assert not ewma.maybe_reset(0.95)
    assert ewma.maybe_reset(torch.tensor(0.85))
    assert ewma.resets == 1
    torch.testing.assert_close(ewma.shadow_parameters()[0], model.weight.detach())
    with pytest.raises(ValueError, match="window"):
        EwmaOldPolicy(model, window=0)
