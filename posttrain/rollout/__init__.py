"""Rollout: the engine protocol (`base`: generate, sync weights, release and wake memory), its backends
(`native/`, `vllm/`) and what a weight push is for each (`weights`)."""
