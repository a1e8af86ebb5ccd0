"""posttrain: reinforcement-learning post-training of LLMs."""

__version__ = "0.1.0"
