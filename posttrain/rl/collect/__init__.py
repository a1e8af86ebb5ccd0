"""Collecting a step's samples: from drawing prompts to a scored RolloutBatch (generation, scoring, the group
filter, truncation), validation, and the rollout's context (what a rollout needs, and nothing the trainer
needs). Synchronous code only: running it ahead of training is `posttrain.rl.overlap`."""
