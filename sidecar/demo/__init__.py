"""`timwatch demo`: a tiny causal LM, a bf16 KV-cache rollout engine, an fp32 trainer and the
service, all in one process."""
