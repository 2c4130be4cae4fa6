"""Engine side: the proxies in front of SGLang and vLLM, what they capture, the prefill probe and
the join of captured rollouts with trainer reports."""
