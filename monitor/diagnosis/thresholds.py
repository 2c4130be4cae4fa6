"""Every threshold of the diagnosis rules, in one place, each with where it comes from.

"measured" values come from the labelled demo runs of ``benchmarks/diagnosis_runs.py``
(docs/diagnosis.md has the table they were read from); "cited" values from the sources named
in docs/diagnosis.md; "chosen" values are judgement, said so.
"""

from __future__ import annotations

__all__ = [
    "CORR_HI",
    "CORR_LO",
    "ENGINE_KL_HI",
    "ENGINE_KL_LO",
    "ENTROPY_FALL_HI",
    "ENTROPY_FALL_LO",
    "FIRES",
    "LENGTH_RISE_HI",
    "LENGTH_RISE_LO",
    "LOW_MU",
    "MIN_BUCKET_TOKENS",
    "NOISE_BF16",
    "NOISE_FP16",
    "PROBE_SHARE_HI",
    "PROBE_SHARE_LO",
    "STALE_KL_HI",
    "STALE_KL_LO",
    "TEACHER_HARD_HI",
    "TEACHER_HARD_LO",
    "TEACHER_RISE_HI",
    "TEACHER_RISE_LO",
    "TOKEN_ID_HI",
]

#: a cause at or above this score is reported as present (chosen: half of the scale)
FIRES = 0.5

#: engine-only KL (discrepancy_kl or the lag-0 mismatch): score 0 at LO, full at HI (measured:
#: fp32 engine ~1e-6, fp16 ~?, bf16 ~?; see docs/diagnosis.md)
ENGINE_KL_LO = 1e-5
ENGINE_KL_HI = 1e-3
#: entropy_delta_corr: rounding error grows with entropy (ESTR law), so a precision gap shows a
#: positive Pearson(δ², H) (measured on the bf16/fp16 demo runs)
CORR_LO = 0.02
CORR_HI = 0.2
#: σ̂² = noise_scale measured on the demo engines at lag 0 (the level of each format's rounding)
NOISE_BF16 = 1e-3
NOISE_FP16 = 1e-4

#: staleness_kl: score 0 at LO, full at HI (measured: lag 3 fp32 demo runs)
STALE_KL_LO = 1e-5
STALE_KL_HI = 1e-3

#: k3 per token of the longest length bucket over the shortest (token-weighted over the window);
#: chosen: a doubling per log2 bucket span is "rising"
LENGTH_RISE_LO = 1.3
LENGTH_RISE_HI = 3.0
#: length buckets with fewer tokens than this are ignored (chosen)
MIN_BUCKET_TOKENS = 64

#: any token id that differs is a bug (exact observation); the score saturates at this share
TOKEN_ID_HI = 1e-3

#: prefill-probe KL / engine KL: below LO the decode path is not where the gap lives, above HI
#: it accounts for all of it (chosen)
PROBE_SHARE_LO = 0.3
PROBE_SHARE_HI = 0.8

#: 1 − late/early entropy_mean: a fall of LO starts counting, HI is a collapse (chosen)
ENTROPY_FALL_LO = 0.2
ENTROPY_FALL_HI = 0.6
#: worst tokens sampled with μ = e^logp_rollout below this are "low-probability" (chosen)
LOW_MU = 0.1

#: teacher_hard_ratio late/early rise and late level (chosen)
TEACHER_RISE_LO = 1.1
TEACHER_RISE_HI = 1.5
TEACHER_HARD_LO = 0.6
TEACHER_HARD_HI = 0.95
