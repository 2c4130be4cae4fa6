"""The rules on the KL decomposition: precision, staleness, decode vs prefill kernels.

Each rule is a pure function of a `StepSeries` that answers a `Finding` (score in [0, 1], a
verdict naming its numbers, an action naming the setting to change) or `NotChecked` (the input
it needs is missing). Thresholds live in ``thresholds.py``; reasoning and sources in
docs/diagnosis.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.numfmt import pct3, sig3
from . import thresholds as th
from .buckets import detail_span, length_growth, merge_buckets
from .findings import Evidence, Finding, NotChecked, ramp, ramp_log
from .series import PROBE_SUFFIX, StepSeries, summarize

__all__ = [
    "EngineGap",
    "decode_vs_prefill",
    "engine_gap",
    "localized",
    "precision",
    "probe_share",
    "staleness",
]


@dataclass(frozen=True)
class EngineGap:
    """The engine-only mismatch (no staleness in it) and where it was read."""

    value: float
    evidence: Evidence


def engine_gap(s: StepSeries) -> EngineGap | None:
    """``discrepancy_kl`` (logp_old vs μ) if sent; else the lag-0 bucket's k3; else
    ``mismatch_kl`` when every step is at lag 0 or no versions were sent (then it may hold
    staleness, which the evidence says)."""
    d = summarize(s, "discrepancy_kl")
    if d.n and d.mean is not None:
        return EngineGap(d.mean, Evidence(
            "discrepancy_kl", (d.first, d.last), d.mean, d.trend,
            "engine-only KL: mean k3 of logp_old − μ (same weights, so no staleness in it)",
        ))  # fmt: skip
    lag0 = [b for b in merge_buckets(s, "lag_buckets") if b.key == 0]
    if lag0:
        b = lag0[0]
        return EngineGap(b.mismatch_kl, Evidence(
            "lag_buckets[0].mismatch_kl", detail_span(s), b.mismatch_kl, None,
            f"mean k3 of the {b.tokens} lag-0 tokens of the steps read",
        ))  # fmt: skip
    m = summarize(s, "mismatch_kl")
    if not m.n or m.mean is None:
        return None
    lag = summarize(s, "version_lag_max")
    if lag.n and (lag.mean or 0) > 0:
        return None  # stale tokens only and no logp_old: the engine's share is unknown
    note = "every step at lag 0" if lag.n else "no versions sent: may include staleness"
    return EngineGap(m.mean, Evidence("mismatch_kl", (m.first, m.last), m.mean, m.trend, note))


_PRECISION_ACTION_FP16 = (
    "The gap sits at FP16's rounding level: the engine already rounds like fp16 (or finer) and "
    "this is what that format leaves. To go lower, match the trainer's kernels and dtype (fp32 "
    "logits/lm_head in both, SGLang `--enable-deterministic-inference` for batch-invariant "
    "kernels); otherwise keep a token correction on: verl "
    "`algorithm.rollout_correction.rollout_is=token`, slime `--use-tis`, or timwatch's ESTR mask."
)
_PRECISION_ACTION = (
    "Run the engine in FP16 or match the kernels: verl "
    "`actor_rollout_ref.rollout.dtype=float16` (the actor's FSDP dtype to match), "
    "SGLang/vLLM `--dtype float16`; "
    "the FP16 study measured ~24x less mismatch than BF16. SGLang "
    "`--enable-deterministic-inference` removes batch-size variance. Until then keep a token "
    "correction on: verl `algorithm.rollout_correction.rollout_is=token`, slime `--use-tis`, "
    "or timwatch's ESTR mask."
)


def localized(s: StepSeries, gap: EngineGap) -> tuple[float, str | None]:
    """How far the evidence localises the engine gap (0 none, 1 fully): in the decode path (the
    probe run's share of it) or in a growth with the response length. Rounding of a format is
    neither: it is there in prefill as in decode, at every position."""
    out, why = 0.0, None
    share = probe_share(s, gap)
    if share is not None and ramp(share, th.PROBE_SHARE_LO, th.PROBE_SHARE_HI) > out:
        out, why = ramp(share, th.PROBE_SHARE_LO, th.PROBE_SHARE_HI), "the decode path holds it"
    growth = length_growth(s, th.MIN_BUCKET_TOKENS)
    if growth is not None:
        rise = ramp_log(growth.per_doubling, th.LENGTH_RISE_LO, th.LENGTH_RISE_HI)
        if rise > out:
            out, why = rise, f"it grows ×{sig3(growth.per_doubling)} per doubling of length"
    return out, why


def probe_share(s: StepSeries, gap: EngineGap | None) -> float | None:
    """The probe run's mean mismatch_kl over the engine-only KL (None without either)."""
    if s.probe is None or gap is None or gap.value <= 0:
        return None
    p = summarize(s.probe, "mismatch_kl")
    return None if p.mean is None else p.mean / gap.value


def precision(s: StepSeries) -> Finding | NotChecked:
    gap = engine_gap(s)
    if gap is None:
        return NotChecked(
            "precision", "no engine-only mismatch: no discrepancy_kl (send logp_old), no lag-0 "
            "tokens and no mismatch_kl free of staleness",
        )  # fmt: skip
    corr = summarize(s, "entropy_delta_corr")
    noise = summarize(s, "noise_scale")
    stale = summarize(s, "staleness_kl")
    level = ramp_log(gap.value, th.ROUNDING_KL_LO, th.ROUNDING_KL_HI)
    corr_f = 0.5 if corr.mean is None else ramp(corr.mean, th.CORR_LO, th.CORR_HI)
    share = 1.0
    if stale.mean is not None and gap.value + stale.mean > 0:
        share = gap.value / (gap.value + stale.mean)
    plausible = 1.0
    if noise.mean is not None:  # far above any format's rounding level: not rounding
        cap = th.NOISE_IMPLAUSIBLE * th.NOISE_BF16
        plausible = 1.0 - ramp_log(noise.mean, cap, 10 * cap)
    where, why = localized(s, gap)
    score = 0.95 * level * (0.8 + 0.2 * corr_f) * (0.3 + 0.7 * share) * plausible
    score *= 1.0 - th.LOCALIZED_SHARE * where
    evidence = [gap.evidence]
    parts = [f"engine-only KL {sig3(gap.value)} ({gap.evidence.metric})"]
    if stale.mean is not None:
        parts.append(f"{pct3(share)} of engine + staleness KL")
    if corr.mean is not None:
        evidence.append(Evidence(
            "entropy_delta_corr", (corr.first, corr.last), corr.mean, corr.trend,
            "Pearson(δ², H): rounding error grows with entropy",
        ))  # fmt: skip
        parts.append(f"Pearson(δ², H) {sig3(corr.mean)}")
    fmt = None
    if noise.mean is not None:
        at = _log(noise.mean)
        fmt, ref = min(
            (("bf16", th.NOISE_BF16), ("fp16", th.NOISE_FP16)), key=lambda p: abs(at - _log(p[1]))
        )
        stable = noise.trend is not None and 0.5 <= noise.trend <= 2.0
        note = (
            f"σ̂² nearest the {fmt} level {sig3(ref)} measured on the demo engine"
            if plausible == 1.0 else f"σ̂² {sig3(noise.mean / ref)}x the {fmt} level: not rounding"
        )  # fmt: skip
        evidence.append(Evidence(
            "noise_scale", (noise.first, noise.last), noise.mean, noise.trend,
            note + ("; stable" if stable else ""),
        ))  # fmt: skip
        parts.append(f"σ̂² {sig3(noise.mean)} (nearest {fmt}'s {sig3(ref)})")
    if why is not None and where > 0:
        parts.append(f"but {why} (a more specific cause)")
    head = "engine precision/kernels" if score >= th.FIRES else "no dominant precision gap"
    action = _PRECISION_ACTION_FP16 if fmt == "fp16" else _PRECISION_ACTION
    return Finding("precision", score, f"{head}: " + ", ".join(parts), action, evidence)


def _log(x: float | None) -> float:
    return math.log(x) if x is not None and x > 0 else -50.0


_STALENESS_ACTION = (
    "Lower the staleness bound of the async trainer (fewer policy versions in flight), and "
    "correct what remains with decoupled PPO (verl `algorithm.rollout_correction.bypass_mode="
    "false` with `rollout_is=token`: π_old anchors the trust region, IS from μ to π_old) or an "
    "EWMA proximal policy; a token mask/TIS alone does not remove a policy gap."
)


def staleness(s: StepSeries) -> Finding | NotChecked:
    st = summarize(s, "staleness_kl")
    disc = summarize(s, "discrepancy_kl")
    lags = merge_buckets(s, "lag_buckets", th.MIN_BUCKET_TOKENS)
    lag = summarize(s, "version_lag_mean")
    if not st.n and not lag.n:
        return NotChecked(
            "staleness", "no logp_old (staleness_kl) and no per-token versions (version_lag_*)"
        )
    evidence: list[Evidence] = []
    parts: list[str] = []
    from_kl = from_lag = 0.0
    if st.mean is not None:
        share = 1.0
        if disc.mean is not None and st.mean + disc.mean > 0:
            share = st.mean / (st.mean + disc.mean)
        from_kl = ramp_log(st.mean, th.STALE_KL_LO, th.STALE_KL_HI) * (0.3 + 0.7 * share)
        ratio = st.mean / disc.mean if disc.mean else None
        evidence.append(Evidence(
            "staleness_kl", (st.first, st.last), st.mean, st.trend,
            "mean k3 of π − logp_old: the policy moved since the engine's weights",
        ))  # fmt: skip
        parts.append(
            f"staleness_kl {sig3(st.mean)}"
            + (f" = {sig3(ratio)}x discrepancy_kl {sig3(disc.mean)}" if ratio is not None else "")
        )
    if len(lags) >= 2 and lags[0].mismatch_kl > 0:
        rise = lags[-1].mismatch_kl / lags[0].mismatch_kl
        from_lag = 0.9 * ramp_log(rise, 1.5, 10.0)
        evidence.append(Evidence(
            "lag_buckets", detail_span(s), rise, None,
            f"k3 at lag {lags[-1].key} / k3 at lag {lags[0].key} "
            f"({sig3(lags[-1].mismatch_kl)} / {sig3(lags[0].mismatch_kl)})",
        ))  # fmt: skip
        parts.append(f"mismatch ×{sig3(rise)} from lag {lags[0].key} to {lags[-1].key}")
    if lag.mean is not None:
        evidence.append(Evidence("version_lag_mean", (lag.first, lag.last), lag.mean, lag.trend))
        parts.append(f"mean lag {sig3(lag.mean)}")
    sw = summarize(s, "intra_switch_ratio")
    if sw.mean is not None and sw.mean > 0:
        evidence.append(Evidence(
            "intra_switch_ratio", (sw.first, sw.last), sw.mean, sw.trend,
            "sequences spanning weight versions (partial rollouts)",
        ))  # fmt: skip
        parts.append(f"{pct3(sw.mean)} of sequences span versions")
    score = max(from_kl, from_lag)
    head = "staleness (off-policy lag)" if score >= th.FIRES else "no dominant staleness"
    return Finding("staleness", score, f"{head}: " + ", ".join(parts), _STALENESS_ACTION, evidence)


_DECODE_ACTION = (
    "The engine's decode path differs from its own prefill: keep the KV cache in the model's "
    "dtype (SGLang/vLLM `--kv-cache-dtype auto`; an fp8 cache without calibrated scales rounds "
    "every cached K and V), use batch-invariant decode kernels (SGLang "
    "`--enable-deterministic-inference`, with an attention backend it supports: "
    "`--attention-backend flashinfer|fa3|triton`) and the same attention implementation as the "
    "trainer; re-check with the probe run."
)


def decode_vs_prefill(s: StepSeries) -> Finding | NotChecked:
    if s.probe is None:
        return NotChecked(
            "decode_vs_prefill", f"no probe run {s.run}{PROBE_SUFFIX} (run `timwatch sidecar` "
            "with --probe-rate to send prefill probes)",
        )  # fmt: skip
    p = summarize(s.probe, "mismatch_kl")
    gap = engine_gap(s)
    share = probe_share(s, gap)
    if share is None or gap is None:
        return NotChecked(
            "decode_vs_prefill", "the probe run or the main run has no engine-only mismatch"
        )
    score = (
        0.95
        * ramp(share, th.PROBE_SHARE_LO, th.PROBE_SHARE_HI)
        * ramp_log(gap.value, th.ROUNDING_KL_LO, th.ROUNDING_KL_HI)
    )
    evidence = [
        Evidence(
            f"{s.run}{PROBE_SUFFIX}:mismatch_kl", (p.first, p.last), p.mean, p.trend,
            "decode μ vs one prefill pass of the same engine and weights",
        ),
        gap.evidence,
    ]  # fmt: skip
    where = (
        "the gap lives in the engine's decode path" if share >= th.PROBE_SHARE_HI
        else "decode ≈ prefill: the gap is between the engine and the trainer"
        if share < th.PROBE_SHARE_LO else "the decode path holds part of the gap"
    )  # fmt: skip
    verdict = (
        f"{where}: probe KL {sig3(p.mean)} = {pct3(share)} of the engine-only KL {sig3(gap.value)}"
    )
    return Finding("decode_vs_prefill", score, verdict, _DECODE_ACTION, evidence)
