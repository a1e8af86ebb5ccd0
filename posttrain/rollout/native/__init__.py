"""The native rollout engine: continuous batching over a slot KV cache, in-process, over Hugging Face modules."""
