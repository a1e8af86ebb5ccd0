"""Rollouts generated ahead of training (`async_training.max_staleness`): step s's samples are drawn while
earlier steps train, by a policy at most ``max_staleness`` updates older than the one that trains on them.

One background thread owns the rollout engine. It runs a FIFO of two kinds of work: "generate step s" and
"load the weights of version v" (a copy the trainer took right after update v). The trainer submits them in
an order that fixes every sample's policy version, whatever the timing:

- before training step s it makes sure rollouts s .. s+k are queued (k = max_staleness) and waits for s;
- after the update of step s it snapshots the actor and queues "load version s".

So rollout s (s > k + 1) was queued right after "load version s-1-k": it samples with the policy of update
s-1-k while the trainer is at s-1, a lag of exactly k (rollouts 1 .. k+1 use the initial weights, lag s-1).
k = 1 is verl's one-step-off-policy schedule; k = 0 is the synchronous loop, run through this machinery.
Which version sampled each row is recorded (``batch.policy_versions``); the rollout-correction machinery
(``algorithm.rollout_correction``) reweights or rejects what the lag made too different.

The trainer never touches the engine while rollouts are in flight: validation and checkpoints first wait for
the queue to drain (:meth:`RolloutAhead.drain`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from posttrain.data.batch import RolloutBatch
from posttrain.models.lora import policy_weights
from posttrain.utils.metrics import PhaseTimer


class RolloutAhead:
    """The queue of rollouts ahead of training. ``generate(step, timer)`` runs one step's rollout phase
    (``posttrain.rl.step.rollout_phase``), ``load(weights)`` puts a snapshot into the engine."""

    def __init__(self, generate, load, sampler, max_staleness: int, start_step: int, total_steps: int):
        self._generate, self._load, self._sampler = generate, load, sampler
        self.max_staleness = max_staleness
        self._total = total_steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-rollout")
        self._pending: dict[int, Future] = {}
        self._sampler_before: dict[int, dict] = {}  # step -> the prompt sampler's state before it drew
        self._next = start_step + 1  # the next step to queue a rollout for
        self._version = start_step  # the update the engine's weights come from (worker thread only)

    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Step ``step``'s batch and rollout metrics (waits for it; queues the rollouts up to step + k)."""
        while self._next <= min(step + self.max_staleness, self._total):
            self._pending[self._next] = self._pool.submit(self._rollout, self._next)
            self._next += 1
        batch, metrics = self._pending.pop(step).result()
        self._sampler_before.pop(step, None)
        lag = (step - 1) - batch.policy_versions
        metrics["async/policy_lag_max"] = float(lag.max())
        metrics["async/policy_lag_mean"] = float(lag.float().mean())
        return batch, metrics

    def push(self, version: int, policy: nn.Module) -> dict[str, float]:
        """Queue the actor's weights after update ``version`` (copied now: the next update changes them)."""
        snapshot = [(name, t.detach().clone()) for name, t in policy_weights(policy)]
        self._pool.submit(self._load_version, version, snapshot)
        return {"async/weights_mib": sum(t.numel() * t.element_size() for _, t in snapshot) / 2**20}

    def drain(self) -> None:
        """Wait until every queued rollout and weight load has run (the engine is idle and holds the last
        pushed weights); rollouts already generated stay queued for their steps."""
        self._pool.submit(lambda: None).result()

    def sampler_state_after(self, step: int) -> dict:
        """The prompt sampler's state as the synchronous loop has it after step ``step`` (for a checkpoint):
        before the first rollout queued beyond ``step`` drew its prompts."""
        self.drain()
        return self._sampler_before.get(step + 1, self._sampler.state_dict())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _rollout(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        self._sampler_before[step] = self._sampler.state_dict()
        timer = PhaseTimer(prefix="async/")  # background seconds: not part of the trainer's step time
        batch, metrics = self._generate(step, timer)
        batch.policy_versions = torch.full((batch.num_rows,), self._version, dtype=torch.long)
        metrics.update(timer.pop())
        metrics["async/policy_version"] = float(self._version)
        return batch, metrics

    def _load_version(self, version: int, snapshot) -> None:
        self._load(snapshot)
        self._version = version
