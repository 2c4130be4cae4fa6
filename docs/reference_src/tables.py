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
        "< 1e-3 bf16, ~1e-5 fp16; > 1e-2 precedes collapse",
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

#: policy → (keeps a token or sequence iff, its origin, its function in core/masks.py)
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
}
