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
    "NOISE_IMPLAUSIBLE",
    "LOCALIZED_SHARE",
    "ROUNDING_KL_HI",
    "ROUNDING_KL_LO",
    "PROBE_SHARE_HI",
    "PROBE_SHARE_LO",
    "STALE_KL_HI",
    "STALE_KL_LO",
    "TEACHER_HARD_HI",
    "TEACHER_HARD_LO",
    "TEACHER_SHRINK_HI",
    "TEACHER_SHRINK_LO",
    "TOKEN_ID_HI",
]

#: a cause at or above this score is reported as present (chosen: half of the scale)
FIRES = 0.5

#: "does the mismatch matter at all" for the entropy-collapse rule: score 0 at LO, full at HI
#: (measured on the demo at lag 0: fp32 engine ~1e-12, fp16 6.0e-6 to 1.2e-5, bf16 5.0e-4 to
#: 8.5e-4; the demo's entropy falls 3-10x on every lag-0 run, so an entropy fall only counts on
#: a mismatch at bf16 level)
ENGINE_KL_LO = 1e-6
ENGINE_KL_HI = 1e-3
#: an engine-only KL above the fp32 floor, up to the rounding level of the finest lossy format
#: (precision, decode vs prefill, length): score 0 at LO, full at HI. Measured on the demo at lag
#: 0 (docs/diagnosis.md): fp32 engine 7e-13 to 1.7e-12, fp16 engine 6.0e-6 to 1.2e-5, bf16
#: 5.0e-4 to 8.5e-4; LO is 1000x the fp32 floor, HI fp16's lowest run, so a gap at any lossy
#: format's rounding level counts in full and fp32's never does
ROUNDING_KL_LO = 1e-9
ROUNDING_KL_HI = 5e-6
#: when the gap is localised — in the decode path (probe share) or growing with length — the
#: specific cause outranks the generic precision one: precision's score is multiplied by
#: 1 - LOCALIZED_SHARE at full localisation (chosen: halved, so precision still shows)
LOCALIZED_SHARE = 0.5
#: entropy_delta_corr: rounding error grows with entropy (ESTR law), so a precision gap should
#: show a positive Pearson(δ², H). Measured on the demo it does not discriminate (−0.14 to 0.16
#: on bf16, fp16 and fp32 engines alike: heavy tails dominate it), so it is a weak factor of the
#: score (0.8 + 0.2·ramp); the ramp itself is chosen
CORR_LO = 0.0
CORR_HI = 0.05
#: σ̂² = noise_scale measured on the demo engines at lag 0, three seeds (the level of each
#: format's rounding): bf16 5.8e-4 to 1.7e-3, fp16 5.4e-6 to 2.7e-5 (fp32 ~1e-12); about the
#: geometric middles of those ranges. They name the format in the verdict, and NOISE_BF16
#: anchors the cap below
NOISE_BF16 = 1.1e-3
NOISE_FP16 = 1.2e-5
#: σ̂² above this many times the bf16 level is not rounding (measured: token-id drift runs
#: 0.38-1.3, staleness runs 0.19-1.2, against bf16's ≤ 1.7e-3 and an fp8 KV cache's ≤ 6.5e-3);
#: the precision score falls to 0 at 10x this
NOISE_IMPLAUSIBLE = 10.0

#: staleness_kl: score 0 at LO, full at HI (chosen as the engine KL's range; measured: lag 3
#: on an fp32 engine 0.14-0.28, lag 4 on bf16 0.19-0.43, lag 0 exactly 0)
STALE_KL_LO = 1e-5
STALE_KL_HI = 1e-3

#: k3 per token ×f per doubling of the response length (token-weighted log-linear fit over the
#: length buckets): score 0 at LO, full at HI. Measured (docs/diagnosis.md, 24 steps, three
#: seeds): ×0.52 to ×1.25 on every run whose engine error does not depend on the position (bf16,
#: fp16, fp8 KV cache, token drift, lag); ×2.50 to ×2.76 on the engine that computes its rotary
#: angles in bf16 (32 responses of 2-64 tokens). LO and HI leave a margin to both
LENGTH_RISE_LO = 1.4
LENGTH_RISE_HI = 2.4
#: length buckets with fewer tokens than this are ignored (chosen)
MIN_BUCKET_TOKENS = 64

#: any token id that differs is a bug (exact observation); the score saturates at this share
TOKEN_ID_HI = 1e-3

#: prefill-probe KL / engine KL: below LO the decode path is not where the gap lives, above HI
#: it accounts for all of it (chosen; measured: 0.85-0.88 with an fp8 decode KV cache, below
#: 0.002 on a bf16 engine whose prefill rounds like its decode)
PROBE_SHARE_LO = 0.3
PROBE_SHARE_HI = 0.8

#: 1 − late/early entropy_mean: a fall of LO starts counting, HI is a collapse (chosen)
ENTROPY_FALL_LO = 0.2
ENTROPY_FALL_HI = 0.6
#: worst tokens sampled with μ = e^logp_rollout below this are "low-probability" (chosen)
LOW_MU = 0.1

#: teacher_hard_ratio: the soft share (1 − hard) shrinking ×LO..HI from the first third to the
#: last, and the last third's level LO..HI. Measured (docs/diagnosis.md, 12 and 24 steps): a
#: teacher at a constant temperature, whose student drifts off it, ends at 0.56-0.85 with the
#: soft share shrunk ×1.1-3.0 (so the shrink alone does not tell them apart; the level does); a
#: teacher annealed 0.7x per step ends at 0.94 or more, shrunk ×6.6 or more
TEACHER_SHRINK_LO = 2.0
TEACHER_SHRINK_HI = 4.0
TEACHER_HARD_LO = 0.86
TEACHER_HARD_HI = 0.94
