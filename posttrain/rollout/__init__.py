"""Rollout: the engine protocol (`base`: generate, sync weights, release and wake memory) and its backends
(`native/`; a vLLM backend is one more package beside it)."""
