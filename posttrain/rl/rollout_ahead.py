"""Rollouts generated ahead of training (`async_training.max_staleness`): step s's samples are drawn while
earlier steps train, by a policy at most ``max_staleness`` updates older than the one that trains on them.

One rollout worker (``posttrain.rl.rollout_worker``) owns the rollout engine and runs, in the order they
were made, two kinds of calls: "generate step s" and "load the weights of version v" (a copy the trainer
took right after update v). It runs on a background thread of this process or in a process of its own
(``posttrain.rl.rollout_hosts``). The trainer makes the calls in an order that fixes every sample's policy
version, whatever the timing:

- before training step s it makes sure rollouts s .. s+k are queued (k = max_staleness) and waits for s;
- after the update of step s it snapshots the actor and queues "load version s".

So rollout s (s > k + 1) was queued right after "load version s-1-k": it samples with the policy of update
s-1-k while the trainer is at s-1, a lag of exactly k (rollouts 1 .. k+1 use the initial weights, lag s-1).
k = 1 is verl's one-step-off-policy schedule; k = 0 is the synchronous loop, run through this machinery.
With partial rollouts (``posttrain.rl.partial_rollout``) "generate s" is two calls: "start s" where
"generate s" was queued, and "finish s" queued when the trainer takes step s (after "load version s-1").
Which version sampled each row is recorded (``batch.policy_versions``); the rollout-correction machinery
(``algorithm.rollout_correction``) reweights or rejects what the lag made too different.

The trainer never touches the engine while rollouts are in flight: validation runs as one more call in the
queue (after the rollouts and weights queued before it), and checkpoints first wait for the queue to drain.
"""

from __future__ import annotations

from concurrent.futures import Future

from torch import nn

from posttrain.data.batch import RolloutBatch
from posttrain.models.lora import policy_weights
from posttrain.rl.rollout_side import GeneratedStep


class RolloutAhead:
    """The queue of rollouts ahead of training, on a host that runs the rollout worker's calls in order
    (``posttrain.rl.rollout_hosts``: a thread, or a Ray actor)."""

    def __init__(self, host, max_staleness: int, start_step: int, total_steps: int, partial: bool = False):
        self.host = host
        self.max_staleness = max_staleness
        self.partial = partial  # rollouts in two calls: "start s" ahead, "finish s" when step s is taken
        self._total = total_steps
        self._pending: dict[int, Future] = {}  # step -> its GeneratedStep
        self._next = start_step + 1  # the next step to queue a rollout for
        self._loads: list[Future] = []  # weight loads not yet seen to have succeeded

    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Step ``step``'s batch and rollout metrics (waits for it; queues the rollouts up to step + k). With
        partial rollouts its finish is queued first (after the newest weights), then the starts up to step + k."""
        if self.partial:
            self._queue("start", step)
            finishing = self.host.call("finish", step)
            self._queue("start", step + self.max_staleness)
            self._pending.pop(step).result()  # its start's error, if it failed
            done: GeneratedStep = finishing.result()
        else:
            self._queue("generate", step + self.max_staleness)
            done = self._pending.pop(step).result()
        self._check_loads()
        batch, metrics = done.batch, done.metrics
        lag = (step - 1) - batch.policy_versions
        metrics["async/policy_lag_max"] = float(lag.max())
        metrics["async/policy_lag_mean"] = float(lag.float().mean())
        return batch, metrics

    def _queue(self, method: str, last: int) -> None:
        """Queue ``method`` for the steps not queued yet up to ``last`` (not beyond the run)."""
        while self._next <= min(last, self._total):
            self._pending[self._next] = self.host.call(method, self._next)
            self._next += 1

    def push(self, version: int, policy: nn.Module) -> dict[str, float]:
        """Queue the actor's weights after update ``version`` (copied now: the next update changes them)."""
        snapshot = [(name, t.detach().clone()) for name, t in policy_weights(policy)]
        self._loads.append(self.host.call("load", version, snapshot))
        return {"async/weights_mib": sum(t.numel() * t.element_size() for _, t in snapshot) / 2**20}

    def validate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """Validate with the last pushed weights, after everything queued so far."""
        return self.host.call("validate", step).result()

    def drain(self) -> None:
        """Wait until every queued rollout and weight load has run (the engine is idle and holds the last
        pushed weights); rollouts already generated stay queued for their steps."""
        self.host.call("ready").result()
        self._check_loads()

    def sampler_state_after(self, step: int) -> dict:
        """The prompt sampler's state as the synchronous loop has it after step ``step`` (for a checkpoint):
        before the first rollout queued beyond ``step`` drew its prompts."""
        if step + 1 in self._pending:
            return self._pending[step + 1].result().sampler_before
        return self.host.call("sampler_state").result()

    def close(self) -> None:
        self.host.close()

    def _check_loads(self) -> None:
        """Raise the error of a weight load that failed (nobody waits on a load, so it would pass unseen)."""
        for fut in [f for f in self._loads if f.done()]:
            self._loads.remove(fut)
            fut.result()
