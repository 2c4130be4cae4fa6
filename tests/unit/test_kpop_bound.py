"""KPop's pre-test (`kpop_maybe`) never clears a token its exact test (`kpop_reject`) rejects.

The engine runs KPop's exact test (a log and a division) only on the tokens the two cheap
bounds cannot clear (the walk's per-segment loop tests the bounds against `kpop_threshold(φ)`);
a cleared token counts as kept. So the bounds must hold wherever the
exact test says "reject": across probabilities from 1e-12 to 1 (both clamps), δ up to the
series switch and the ±20 range, and thresholds φ from 1e-9 up, with the exact test computed
as the kernel computes it (e^π as q·r from the same series).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from timwatch.monitor.core.fastmath import exp, k3_rm1_r
from timwatch.monitor.core.kernels_walk import kpop_maybe, kpop_reject, kpop_threshold


@njit(cache=False, error_model="numpy", fastmath={"reassoc", "nsz", "contract"})
def _sweep(mu, pi, phi):  # type: ignore[no-untyped-def]
    """(tokens the exact test rejects, of them cleared by the bounds, candidates)."""
    half = kpop_threshold(phi)
    rejected = missed = candidates = 0
    for j in range(mu.shape[0]):
        m = mu[j]
        p = pi[j]
        rm1 = k3_rm1_r(p - m)[1]
        q = exp(m)
        pp = q + q * rm1
        rej = kpop_reject(pp, q, p, m, phi)
        maybe = kpop_maybe(pp, q, p, m, half)
        rejected += rej
        missed += rej and not maybe
        candidates += maybe
    return rejected, missed, candidates


def _tokens(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities near 0 (p → 1), mid-range and deep (p → 0, past the 1e-8 clamp), with
    δ from 1e-6 to 20 of either sign, and π clamped at 0 as log-probabilities are."""
    mu = np.concatenate(
        [
            -(10.0 ** rng.uniform(-12, 0.5, n)),
            -rng.uniform(0.0, 30.0, n),
            -(10.0 ** rng.uniform(-9, -6, n)),
        ]
    )
    delta = np.sign(rng.normal(size=mu.shape[0])) * 10.0 ** rng.uniform(-6, np.log10(20), mu.shape)
    pi = np.minimum(mu + delta, 0.0)
    return mu, pi


def test_the_bounds_never_clear_a_rejected_token() -> None:
    rng = np.random.default_rng(2026)
    mu, pi = _tokens(rng, 200_000)
    for phi in (1e-9, 1e-6, 1e-3, 0.01, 0.1, 0.5, 2.0, 10.0):
        rejected, missed, candidates = _sweep(mu, pi, phi)
        assert missed == 0, (phi, missed, rejected)
        assert rejected <= candidates <= mu.shape[0]
        if phi == 0.1:  # the test is real: both outcomes occur, and the bounds clear most
            assert 0 < rejected and candidates < mu.shape[0] // 2


def test_tiny_phi_makes_every_token_a_candidate() -> None:
    mu, pi = _tokens(np.random.default_rng(5), 2_000)
    for phi in (0.0, 1e-12):
        rejected, missed, candidates = _sweep(mu, pi, phi)
        assert missed == 0 and candidates == mu.shape[0]
