"""The rules on the shape of the mismatch: length, token-id round trip, entropy collapse and
low-probability tokens, distillation teacher collapse. Same contract as ``rules.py``."""

from __future__ import annotations

import numpy as np

from ..core.numfmt import pct3, sig3
from . import thresholds as th
from .buckets import detail_span, length_growth, worst_mu
from .findings import Evidence, Finding, NotChecked, ramp, ramp_log
from .series import StepSeries, summarize

__all__ = ["entropy_collapse", "length", "teacher_collapse", "tokenization"]

_LENGTH_ACTION = (
    "Correct at the sequence level, where long responses pay most: verl "
    "`algorithm.rollout_correction.rollout_rs=geometric` (Geo-RS, `rollout_rs_threshold` ~1.001) "
    "or `rollout_is=sequence` (seq-MIS), timwatch's `geo_rs` / `seq_mis` policies; cap the "
    "response length while the mismatch grows. An engine error that grows with the position is "
    "numeric: check that the engine computes its rotary angles (RoPE cos/sin cache) in fp32, as "
    "transformers forces since PR #29285."
)


def length(s: StepSeries) -> Finding | NotChecked:
    growth = length_growth(s, th.MIN_BUCKET_TOKENS)
    if growth is None:
        return NotChecked(
            "length", f"fewer than 2 length buckets with ≥ {th.MIN_BUCKET_TOKENS} tokens "
            "(responses of about one length, or no details stored)",
        )  # fmt: skip
    per_doubling, buckets = growth.per_doubling, growth.buckets
    level = ramp_log(summarize(s, "mismatch_kl").mean, th.ROUNDING_KL_LO, th.ROUNDING_KL_HI)
    score = 0.9 * ramp_log(per_doubling, th.LENGTH_RISE_LO, th.LENGTH_RISE_HI)
    score *= 0.3 + 0.7 * level
    lo, hi = buckets[0], buckets[-1]
    evidence = [Evidence(
        "length_buckets", detail_span(s), per_doubling, None,
        f"k3 per token ×{sig3(per_doubling)} per doubling of length (token-weighted fit over "
        f"{len(buckets)} buckets): {sig3(lo.mismatch_kl)} at 2^{lo.key} tokens, "
        f"{sig3(hi.mismatch_kl)} at 2^{hi.key}",
    )]  # fmt: skip
    sl = summarize(s, "seq_log_ratio_abs_mean")
    if sl.mean is not None:
        evidence.append(Evidence("seq_log_ratio_abs_mean", (sl.first, sl.last), sl.mean, sl.trend))
    head = "mismatch grows with length" if score >= th.FIRES else "no length effect"
    verdict = (
        f"{head}: k3 per token ×{sig3(per_doubling)} per doubling of response length "
        f"({sig3(lo.mismatch_kl)} at 2^{lo.key} tokens, {sig3(hi.mismatch_kl)} at 2^{hi.key})"
    )
    return Finding("length", score, verdict, _LENGTH_ACTION, evidence)


_TOKEN_ACTION = (
    "Pass token ids, never text, from the engine to the trainer (a detokenize → retokenize "
    "does not round-trip): return the engine's output ids (SGLang `--skip-tokenizer-init` "
    "takes and returns ids) and train on exactly those."
)


def tokenization(s: StepSeries) -> Finding | NotChecked:
    t = summarize(s, "token_id_mismatch_ratio")
    if not t.n:
        return NotChecked("tokenization", "no token_ids and token_ids_train in the batches")
    vals = s.col("token_id_mismatch_ratio")
    bad = np.isfinite(vals) & (vals > 0)
    n_bad = int(bad.sum())
    worst = float(np.nanmax(vals))
    score = 0.96 + 0.04 * ramp_log(worst, 1e-5, th.TOKEN_ID_HI) if n_bad else 0.0
    first_bad = int(s.steps[bad][0]) if n_bad else None
    evidence = [Evidence(
        "token_id_mismatch_ratio", (t.first, t.last), t.mean, t.trend,
        f"{n_bad} of {t.n} steps with differing ids" + (f", first at step {first_bad}"
                                                        if first_bad is not None else ""),
    )]  # fmt: skip
    verdict = (
        f"token ids differ between engine and trainer on {n_bad} of {t.n} steps "
        f"(mean share {sig3(t.mean)}, max {sig3(worst)}): π is computed on other tokens"
        if n_bad else f"token ids match on all {t.n} steps"
    )  # fmt: skip
    return Finding("tokenization", score, verdict, _TOKEN_ACTION, evidence)


_ENTROPY_ACTION = (
    "The policy is collapsing onto few tokens and the mismatch concentrates on the rare ones it "
    "still samples: keep entropy up (verl `actor_rollout_ref.actor.entropy_coeff`, clip-higher) "
    "and mask by the entropy-scaled ESTR score rather than raw |δ| (timwatch `estr`), so "
    "low-probability tokens are not all rejected."
)


def entropy_collapse(s: StepSeries) -> Finding | NotChecked:
    e = summarize(s, "entropy_mean")
    if not e.n or e.mean is None:
        return NotChecked("entropy_collapse", "no entropy sent (entropy_source unset)")
    fall = 0.0 if e.trend is None else 1.0 - e.trend
    mus = worst_mu(s)
    low = sum(m < th.LOW_MU for m in mus) / len(mus) if mus else 0.0
    noise = summarize(s, "noise_scale")
    # the mismatch per unit entropy (σ̂²) rising as entropy falls: the rare tokens carry it
    rising = 0.75 if noise.trend is None else 0.5 + 0.5 * ramp_log(noise.trend, 1.0, 2.0)
    # an entropy fall is no cause of a mismatch that is negligible anyway
    level = ramp_log(summarize(s, "mismatch_kl").mean, th.ENGINE_KL_LO, th.ENGINE_KL_HI)
    score = 0.9 * ramp(fall, th.ENTROPY_FALL_LO, th.ENTROPY_FALL_HI) * (0.6 + 0.4 * low)
    score *= rising * level
    evidence = [
        Evidence("entropy_mean", (e.first, e.last), e.mean, e.trend, f"late/early {sig3(e.trend)}")
    ]
    parts = [f"entropy_mean late/early {sig3(e.trend)}"]
    if noise.trend is not None:
        evidence.append(Evidence(
            "noise_scale", (noise.first, noise.last), noise.mean, noise.trend,
            "σ̂² = Σδ²/Σ(H+ε): mismatch per unit entropy",
        ))  # fmt: skip
        parts.append(f"σ̂² late/early {sig3(noise.trend)}")
    if mus:
        evidence.append(Evidence(
            "worst_tokens", detail_span(s), low, None,
            f"share of {len(mus)} worst tokens sampled at μ < {sig3(th.LOW_MU)}",
        ))  # fmt: skip
        parts.append(f"{pct3(low)} of the worst tokens at μ < {sig3(th.LOW_MU)}")
    es, da = summarize(s, "mask_ratio_estr"), summarize(s, "mask_ratio_delta_abs")
    if es.trend is not None and da.trend is not None and da.trend > 0:
        div = es.trend / da.trend
        evidence.append(Evidence(
            "mask_ratio_estr/mask_ratio_delta_abs", (es.first, es.last), div, None,
            f"late/early of ESTR rejections {sig3(es.trend)} over |δ| rejections {sig3(da.trend)}",
        ))  # fmt: skip
        parts.append(f"ESTR vs |δ| mask trends ×{sig3(div)}")
    head = "entropy collapse drives it" if score >= th.FIRES else "no entropy-driven mismatch"
    return Finding("entropy_collapse", score, f"{head}: " + ", ".join(parts), _ENTROPY_ACTION,
                   evidence)  # fmt: skip


_TEACHER_ACTION = (
    "The teacher has become near-deterministic on the student's samples (few soft targets left): "
    "check the teacher-temperature schedule and raise the temperature, check the teacher's "
    "checkpoint, or weight the distillation loss down on hard tokens."
)


def teacher_collapse(s: StepSeries) -> Finding | NotChecked:
    t = summarize(s, "teacher_hard_ratio")
    if not t.n or t.mean is None:
        return NotChecked("teacher_collapse", "no logp_teacher (not a distillation run)")
    vals = s.col("teacher_hard_ratio")
    vals = vals[np.isfinite(vals)]
    k = max(1, len(vals) // 3)
    early, late = float(np.mean(vals[:k])), float(np.mean(vals[-k:]))
    # the hard ratio is bounded by 1, so its rise is read on the soft share left (1 − hard)
    shrink = (1.0 - early) / max(1.0 - late, 1e-6) if len(vals) >= 3 else None
    score = 0.9 * ramp_log(shrink, th.TEACHER_SHRINK_LO, th.TEACHER_SHRINK_HI)
    score *= ramp(late, th.TEACHER_HARD_LO, th.TEACHER_HARD_HI)
    evidence = [Evidence(
        "teacher_hard_ratio", (t.first, t.last), t.mean, t.trend,
        f"first third {sig3(early)}, last third {sig3(late)}: the soft share 1 − hard shrank "
        f"×{sig3(shrink)}",
    )]  # fmt: skip
    soft = summarize(s, "teacher_soft_ratio")
    if soft.mean is not None:
        evidence.append(Evidence("teacher_soft_ratio", (soft.first, soft.last), soft.mean,
                                 soft.trend))  # fmt: skip
    head = "teacher collapse" if score >= th.FIRES else "teacher holds"
    verdict = (
        f"{head}: teacher_hard_ratio {sig3(early)} → {sig3(late)} (first → last third), the "
        f"share of tokens with a soft teacher probability shrank ×{sig3(shrink)}"
    )
    return Finding("teacher_collapse", score, verdict, _TEACHER_ACTION, evidence)
