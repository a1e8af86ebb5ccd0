"""Rollouts ahead of training (`async_training`): the queue the trainer takes batches from, the rollout
worker and where it runs (a thread, a process, a Ray actor), and partial rollouts."""
