"""Supervised fine-tuning and the built-in model (a tiny Qwen2 warm-started with SFT)."""
