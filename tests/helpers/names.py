"""The exported metric families, written out once for the tests (independently of the exporter,
the dashboards generator and the rules, which they check)."""

from __future__ import annotations

COUNTERS = [
    "timwatch_tokens_total",
    "timwatch_sequences_total",
    "timwatch_batches_total",
    "timwatch_masked_tokens_total",
    "timwatch_rejected_batches_total",
    "timwatch_token_id_checked_tokens_total",
    "timwatch_token_id_mismatched_tokens_total",
]
SUMMARIES = [
    "timwatch_token_kl",
    "timwatch_token_log_ratio_squared",
    "timwatch_token_entropy",
    "timwatch_token_is_ratio",
    "timwatch_token_is_ratio_squared",
]
HISTOGRAMS = [
    "timwatch_token_abs_log_ratio",
    "timwatch_token_estr_score",
    "timwatch_token_version_lag",
]
# gauges exact fleet-wide under max by (run): the only gauges dashboards and alerts read
GAUGES = ["timwatch_step", "timwatch_last_batch_timestamp_seconds"]
# latest-step gauges: per replica, partial when a step's batches land on several replicas;
# exported for a look at one process, read by no dashboard panel and no alert
PARTIAL_STEP_GAUGES = [
    "timwatch_mismatch_kl",
    "timwatch_is_ratio_std",
    "timwatch_log_ratio_abs_max",
    "timwatch_mask_ratio",
    "timwatch_entropy_mean",
    "timwatch_noise_scale",
    "timwatch_version_lag_max",
    "timwatch_token_id_mismatch_ratio",
]
# verl-parity families (issue 11): exported and additive, not (yet) on the dashboards
VERL_COUNTERS = [
    "timwatch_is_ratio_low_tokens_total",
    "timwatch_seq_is_ratio_out_of_bounds_sequences_total",
]
VERL_SUMMARIES = [
    "timwatch_token_tis_weight",
    "timwatch_token_prob_abs_diff",
    "timwatch_seq_training_log_ppl",
    "timwatch_seq_rollout_log_ppl",
    "timwatch_seq_training_ppl",
    "timwatch_seq_rollout_ppl",
    "timwatch_seq_log_ppl_diff",
    "timwatch_seq_ppl_ratio",
    "timwatch_seq_is_weight",
]
# run lifecycle and tap losses (issue 9): exported, read by the alert rules, not on the dashboards
LIFECYCLE_COUNTERS = ["timwatch_tap_dropped_batches_total"]
LIFECYCLE_GAUGES = ["timwatch_run_finished"]
# the trainer's own scalars (issue 33), latest post per replica, under max by (run, source):
# the ones the run dashboard reads (the exporter has one family per canonical name)
SCALAR_GAUGES = [
    *(f"timwatch_scalar_{n}" for n in (
        "mismatch_kl", "kl_k1", "log_ratio_abs_mean", "log_ratio_abs_max", "is_weight_mean",
        "correction_masked_fraction", "exp_abs_log_ratio_mean", "reward_mean", "reward_std",
        "grad_norm", "loss", "entropy", "clip_fraction", "response_length_mean",
        "response_length_max", "learning_rate",
    )),
]  # fmt: skip
SCALAR_COUNTERS = ["timwatch_rejected_scalar_posts_total"]
# every exposed series name -> its metric family (summaries and histograms expand)
FAMILY_OF = (
    {c: c for c in COUNTERS + GAUGES + PARTIAL_STEP_GAUGES + VERL_COUNTERS}
    | {c: c for c in SCALAR_GAUGES + SCALAR_COUNTERS + ["timwatch_scalar_step"]}
    | {c: c for c in LIFECYCLE_COUNTERS + LIFECYCLE_GAUGES}
    | {f"{s}{suffix}": s for s in SUMMARIES + VERL_SUMMARIES for suffix in ("_sum", "_count")}
    | {f"{h}{suffix}": h for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
)
EXPORTED_SERIES = frozenset(FAMILY_OF)
