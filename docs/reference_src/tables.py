"""The hand-written half of docs/reference/: what the code cannot say about its own names.

docs/generate_reference.py merges each table with the code's single list of names (the batch
fields of monitor/core/batch.py, `dataclasses.fields(MetricRow)`, `POLICIES`) and fails when a
name has no entry here or an entry names nothing, so a new field or policy cannot ship
undocumented and a removed one cannot linger.
"""

from __future__ import annotations

__all__ = ["BATCH_FIELDS", "BATCH_METADATA", "METRICS", "POLICY_RULES"]

#: batch field → what it holds
BATCH_FIELDS: dict[str, str] = {
    "cu_seqlens": (
        "sequence offsets: 0, then the running token count after each sequence (empty sequences "
        "allowed)"
    ),
    "logp_rollout": "μ: log-prob of each sampled token under the rollout engine",
    "logp_train": "π: log-prob of the same token recomputed by the trainer",
    "entropy": "H: next-token entropy in nats at each position (its source: `entropy_source`)",
    "loss_mask": "1 for tokens that count (response tokens), 0 for prompt, tool output, padding",
    "token_ids": "the token ids the engine sampled",
    "token_ids_train": (
        "the token ids the trainer fed; differences are retokenization drift "
        "(`token_id_mismatch_ratio`)"
    ),
    "versions": (
        "weight version that sampled each token; a version newer than `policy_version` is "
        "accepted and shows as a negative lag (engine and trainer numbering that do not match)"
    ),
    "logp_old": (
        "log-prob under the old (behaviour-proximal) policy of decoupled PPO: `discrepancy_kl`, "
        "`staleness_kl`"
    ),
    "logp_teacher": (
        "log-prob under a distillation teacher: `teacher_soft_ratio`, `teacher_hard_ratio`"
    ),
}

#: batch metadata key → what it means
BATCH_METADATA: dict[str, str] = {
    "step": (
        "the trainer step; the history's x axis. Several batches of one step merge into one step "
        "row"
    ),
    "batch_id": (
        "idempotency key: a batch posted again with the same id is answered from the store and "
        "counted once. Without it every post counts"
    ),
    "policy_version": (
        "the trainer's weight version; with `versions` it gives `version_lag_*` and `lag_buckets`"
    ),
    "entropy_source": (
        "where H came from: the engine's full distribution, a top-k lower bound, or the trainer's"
        " logits"
    ),
}

#: MetricRow field → (formula, healthy range or "")
METRICS: dict[str, tuple[str, str]] = {
    "step": (
        "the batch's `step`; the largest one for a merged row",
        "",
    ),
    "batches": (
        "batches merged into the row (a replayed batch is not counted)",
        "",
    ),
    "policy_version": (
        "the batch's `policy_version`; the largest one for a merged row",
        "",
    ),
    "entropy_source": (
        (
            "the batch's `entropy_source` (`rollout`, `topk`, `trainer`); `mixed` for a merged "
            "row of different sources"
        ),
        "",
    ),
    "tokens": (
        "N: masked tokens (`loss_mask = 1`)",
        "",
    ),
    "sequences": (
        "sequences with at least one masked token",
        "",
    ),
    "mismatch_kl": (
        ("mean k3: unbiased, non-negative estimate of KL(μ‖π), exact down to FP16-size δ"),
        "< 1e-3 bf16, ~1e-5 fp16; > 2e-2 off-policy",
    ),
    "kl_k1": (
        "mean k1 = mean −δ",
        "",
    ),
    "kl_k2": (
        "mean k2 = mean δ²/2",
        "",
    ),
    "log_ratio_mean": (
        "mean δ",
        "≈ 0",
    ),
    "log_ratio_abs_mean": (
        "mean |δ|",
        "",
    ),
    "log_ratio_abs_max": (
        "max |δ|",
        "< 1",
    ),
    "log_ratio_abs_p99": (
        "99th percentile of |δ| from the fine log histogram (±0.4 %, see Details)",
        "< 0.1",
    ),
    "prob_abs_diff_mean": (
        "mean |e^π − e^μ| (verl's `rollout_probs_diff_mean`)",
        "< 0.005; > 0.01 a precision problem",
    ),
    "prob_abs_diff_max": (
        "max |e^π − e^μ| (verl's `rollout_probs_diff_max`)",
        "",
    ),
    "is_ratio_mean": (
        "mean r",
        "≈ 1",
    ),
    "is_ratio_std": (
        "population standard deviation of r",
        "< 0.1",
    ),
    "is_ratio_min": (
        "min r = e^{clip(min δ)} (r is monotone in δ: full precision at r ≈ e^−20)",
        "",
    ),
    "is_ratio_max": (
        "max r = e^{clip(max δ)}",
        "",
    ),
    "is_ess": (
        "effective sample size (Σr)² / (N·Σr²)",
        "> 0.99",
    ),
    "chi2_token": (
        "mean r² − 1",
        "",
    ),
    "seq_log_ratio_abs_mean": (
        "mean over sequences of |L_s|",
        "grows with length",
    ),
    "seq_log_ratio_abs_max": (
        "max over sequences of |L_s|",
        "",
    ),
    "seq_geo_ratio_mean": (
        "mean over sequences of e^{clip(L_s / n_s, ±20)}",
        "≈ 1",
    ),
    "chi2_seq": (
        "mean over sequences of e^{2·clip(L_s, ±20)} − 1",
        "",
    ),
    "entropy_mean": (
        "mean H",
        "slow drift; a steady fall toward 0 is entropy collapse",
    ),
    "noise_scale": (
        "σ̂² = Σδ² / Σ(H + ε): the ESTR law E[δ²] ≈ σ²H with entropy drift divided out",
        "flat",
    ),
    "entropy_delta_corr": (
        "Pearson correlation of δ² and H; `null` when N < 2 or either is constant",
        "positive",
    ),
    "version_lag_mean": (
        (
            "mean over masked tokens of lag = policy_version − v_t; needs `versions` and "
            "`policy_version`"
        ),
        "≤ your staleness bound",
    ),
    "version_lag_max": (
        "max lag; needs `versions` and `policy_version`",
        "0 synchronous; ≤ the staleness bound async",
    ),
    "intra_switch_ratio": (
        "share of sequences whose masked tokens carry more than one version; needs `versions`",
        "",
    ),
    "token_id_mismatch_ratio": (
        "share of masked tokens with `token_ids` ≠ `token_ids_train`; needs both",
        "exactly 0",
    ),
    "discrepancy_kl": (
        "mean k3 of (`logp_old` − μ); needs `logp_old`",
        "",
    ),
    "staleness_kl": (
        "mean k3 of (π − `logp_old`); needs `logp_old`",
        "",
    ),
    "teacher_soft_ratio": (
        "share of masked tokens with e^`logp_teacher` in [0.3, 0.7]; needs `logp_teacher`",
        "",
    ),
    "teacher_hard_ratio": (
        "share of masked tokens with e^`logp_teacher` < 0.05 or > 0.95; needs `logp_teacher`",
        "",
    ),
    "nonfinite_tokens": (
        (
            'positions dropped for non-finite floats (`nonfinite="drop"`, [batch.md](batch.md)); '
            "0 otherwise"
        ),
        "",
    ),
    "impossible_tokens": (
        (
            "kept positions where one side gives the token probability 0 (one of "
            "`logp_rollout`, `logp_train` is -inf, the other finite: δ = ±∞); taken out of "
            "the loss mask and every other metric, counted here instead of refusing the batch"
        ),
        "",
    ),
    "is_ratio_fraction_low": (
        "share of T with r < 1/C (C = `tis_c`); the high side is `mask_ratio.tis` "
        "(verl `rollout_is_ratio_fraction_low`)",
        "",
    ),
    "tis_weight_mean": (
        "mean of the truncated weight w = min(r, C) (verl `rollout_is_mean`, token TIS)",
        "≈ 1",
    ),
    "tis_weight_std": (
        "population std of w = min(r, C) (verl `rollout_is_std`); `is_ratio_std` is on raw r",
        "",
    ),
    "tis_weight_ess": (
        "(Σw)² / (N Σw²) on w = min(r, C) (verl `rollout_is_eff_sample_size`); `is_ess` is on "
        "raw r",
        "",
    ),
    "prob_abs_diff_std": (
        "sample std (N − 1) of |e^π − e^μ|; null for N < 2 "
        "(verl `training/rollout_probs_diff_std`)",
        "",
    ),
    "prob_pearson_corr": (
        "Pearson(e^π, e^μ) over T; null for N < 2 or a zero variance "
        "(verl `training/rollout_actor_probs_pearson_corr`)",
        "≈ 1",
    ),
    "training_log_ppl": (
        "mean over sequences of −mean_s π (verl `training_log_ppl`)",
        "",
    ),
    "rollout_log_ppl": (
        "mean over sequences of −mean_s μ (verl `rollout_log_ppl`)",
        "",
    ),
    "training_ppl": (
        "mean over sequences of exp(−mean_s π), exponent capped at 600 (verl `training_ppl`)",
        "",
    ),
    "rollout_ppl": (
        "mean over sequences of exp(−mean_s μ), exponent capped at 600 (verl `rollout_ppl`)",
        "",
    ),
    "log_ppl_diff": (
        "mean over sequences of g_s = mean_s μ − mean_s π = −L_s / n_s (verl `log_ppl_diff`)",
        "≈ 0",
    ),
    "log_ppl_abs_diff": (
        "mean over sequences of |g_s| (verl `log_ppl_abs_diff`)",
        "",
    ),
    "log_ppl_diff_max": (
        "max over sequences of g_s (verl `log_ppl_diff_max`)",
        "",
    ),
    "log_ppl_diff_min": (
        "min over sequences of g_s (verl `log_ppl_diff_min`)",
        "",
    ),
    "ppl_ratio": (
        "mean over sequences of exp(clip(g_s, ±600)) (verl `ppl_ratio`)",
        "≈ 1",
    ),
    "seq_is_weight_mean": (
        "mean over sequences of w̄_s = mean_s min(r, C) (verl `rollout_is_seq_mean`)",
        "",
    ),
    "seq_is_weight_std": (
        "sample std (S − 1) of w̄_s; null for one sequence (verl `rollout_is_seq_std`)",
        "",
    ),
    "seq_is_weight_max": (
        "max over sequences of w̄_s (verl `rollout_is_seq_max`)",
        "",
    ),
    "seq_is_weight_min": (
        "min over sequences of w̄_s (verl `rollout_is_seq_min`)",
        "",
    ),
    "seq_is_weight_max_deviation": (
        "max over sequences of |w̄_s − 1| (verl `rollout_is_seq_max_deviation`)",
        "",
    ),
    "seq_is_ratio_fraction_high": (
        "share of sequences whose mean raw r is > C (verl `rollout_is_seq_fraction_high`)",
        "",
    ),
    "seq_is_ratio_fraction_low": (
        "share of sequences whose mean raw r is < 1/C (verl `rollout_is_seq_fraction_low`)",
        "",
    ),
    "mask_ratio": (
        "per policy: rejected masked tokens / N (shadow evaluation of every policy)",
        "< 1 % for estr and icepop",
    ),
    "seq_reject_ratio": (
        "per sequence policy: rejected sequences / sequences",
        "",
    ),
    "length_buckets": (
        "per ⌊log2 n_s⌋: sequences, tokens, mean |L_s|, mean k3 (see Details)",
        "",
    ),
    "heatmap": (
        "token counts on an H × |δ| grid, all and ESTR-rejected (see Details)",
        "",
    ),
    "lag_buckets": (
        "per version lag: tokens, mean k3; `null` without versions (see Details)",
        "",
    ),
    "worst_tokens": (
        "the top tokens by S with their position, id, μ, π, H (see Details)",
        "",
    ),
}

#: policy → (keeps a token or sequence iff, its origin, its function in core/masks.py or
#: core/rs_modes.py)
POLICY_RULES: dict[str, tuple[str, str, str]] = {
    "estr": (
        "δ² ≤ τ(H + ε): the trust region widens with the token's entropy",
        "Entropy-Scaled Trust Region",
        "estr_keep_mask",
    ),
    "delta_abs": (
        "|δ| ≤ √(τC), evaluated as δ² ≤ τC: ESTR with H + ε ≡ C (τ shared with ESTR)",
        "fixed threshold on |δ|",
        "delta_abs_keep_mask",
    ),
    "icepop": (
        "α ≤ r ≤ β",
        "IcePop (Ring-1T); verl, AReaL",
        "icepop_keep_mask",
    ),
    "kpop": (
        "max(D_B(p‖q), D_B(q‖p)) ≤ φ, p = e^π, q = e^μ",
        "KPop",
        "kpop_keep_mask",
    ),
    "tis": (
        'r ≤ C (truncated above C; "rejected" = truncated)',
        "TIS; verl, slime",
        "tis_keep_mask",
    ),
    "seq_mis": (
        "lo ≤ e^{L_s} ≤ hi",
        "sequence-level MIS",
        "seq_mis_keep_mask",
    ),
    "geo_rs": (
        "lo ≤ e^{L_s / n_s} ≤ hi",
        "verl Geo-RS",
        "geo_rs_keep_mask",
    ),
    "k3_rs": (
        "mean_{t∈s} k3_t ≤ κ",
        "verl K3-RS",
        "k3_rs_keep_mask",
    ),
    "token_k1": (
        "ln(lo) ≤ −δc ≤ ln(hi): bounds on 1/r, as verl's `token_k1` mode",
        "verl rejection sampling (`rollout_rs`)",
        "token_k1_keep_mask",
    ),
    "token_k2": (
        "δc²/2 ≤ t",
        "verl rejection sampling (`rollout_rs`)",
        "token_k2_keep_mask",
    ),
    "token_k3": (
        "k3 ≤ t",
        "verl rejection sampling (`rollout_rs`)",
        "token_k3_keep_mask",
    ),
    "seq_sum_k2": (
        "Σ_{t∈s} δc²/2 ≤ t",
        "verl rejection sampling (`rollout_rs`)",
        "seq_sum_k2_keep_mask",
    ),
    "seq_sum_k3": (
        "Σ_{t∈s} k3_t ≤ t",
        "verl rejection sampling (`rollout_rs`)",
        "seq_sum_k3_keep_mask",
    ),
    "seq_mean_k2": (
        "mean_{t∈s} δc²/2 ≤ t",
        "verl rejection sampling (`rollout_rs`)",
        "seq_mean_k2_keep_mask",
    ),
    "seq_max_k2": (
        "max_{t∈s} δc²/2 ≤ t",
        "verl rejection sampling (`rollout_rs`)",
        "seq_max_k2_keep_mask",
    ),
    "seq_max_k3": (
        "max_{t∈s} k3_t ≤ t",
        "verl rejection sampling (`rollout_rs`)",
        "seq_max_k3_keep_mask",
    ),
}
