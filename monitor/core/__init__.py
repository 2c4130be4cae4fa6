"""The numeric core: the validated batch model, the fused metric engine, additive accumulators,
metric rows and the mask policies. It imports numpy and numba only: never torch, the service,
the store, the CLI or the sidecar."""
