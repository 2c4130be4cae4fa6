"""The collapse lab: GRPO on a tiny causal LM whose rollout engine differs from its fp32 trainer
the way real engines do, reported through the real path (Tap → a `timwatch serve` subprocess),
with the shipped alert rules replayed over each run's exported series by `promtool test rules`.

Run ``python -m benchmarks.collapse_lab --config NAME [--seed N]``; docs/early-warning.md has the
table and what it shows. Collapse is defined in `configs.collapse_onset` before any run is made.
"""
