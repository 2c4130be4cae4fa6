"""Collapse lab v2: GRPO on a pretrained ~1M-parameter causal LM over a 2,048-token vocabulary
with a long-tailed synthetic corpus, 64-token responses decoded with a KV cache, a graded
verifiable reward, and rollout engines that differ from the fp32 trainer as real ones do.

Lab v1 (``benchmarks.collapse_lab``) and its tables stay as they are; v2 reuses its server, its
replay through the shipped rules and its collapse definition. ``PROTOCOL.md`` fixes the
evaluation before any grid was run; docs/early-warning.md ("Lab v2") has the cost and results.
"""
