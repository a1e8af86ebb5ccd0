"""Rollouts generated ahead of training (`async_training.max_staleness`): step s's samples are drawn while
earlier steps train, by a policy at most ``max_staleness`` updates older than the one that trains on them.

One rollout worker (``posttrain.rl.overlap.worker``) owns the rollout engine and runs, in the order they
were made, two kinds of calls: "generate step s" and "load the weights of version v" (a copy the trainer
took right after update v). It runs on a background thread of this process or in a process of its own
(``posttrain.rl.overlap.hosts``). The trainer makes the calls in an order that fixes every sample's policy
version, whatever the timing:

- before training step s it makes sure rollouts s .. s+k are queued (k = max_staleness) and waits for s;
- after the update of step s it snapshots the actor and queues "load version s".

So rollout s (s > k + 1) was queued right after "load version s-1-k": it samples with the policy of update
s-1-k while the trainer is at s-1, a lag of exactly k (rollouts 1 .. k+1 use the initial weights, lag s-1).
k = 1 is verl's one-step-off-policy schedule; k = 0 is the synchronous loop, run through this machinery.
With partial rollouts (``posttrain.rl.overlap.partial``) "generate s" is two calls: "start s" where
"generate s" was queued, and "finish s" queued when the trainer takes step s (after "load version s-1").
Which version sampled each row is recorded (``batch.policy_versions``); the rollout-correction machinery
(``algorithm.rollout_correction``) reweights or rejects what the lag made too different.

The trainer never touches the engine while rollouts are in flight: validation runs as one more call in the
queue (after the rollouts and weights queued before it), and checkpoints first wait for the queue to drain.

With several trainer ranks (a worker Ray placed; a thread is refused, ``posttrain.rl.checks``) rank 0 alone
talks to the worker, which generates whole steps. Rank 0 sends each step (and every validation) to the other
ranks, and each keeps its data share of it, the groups the synchronous loop would have given it. Every rank
takes part in gathering the sharded weights for a push; rank 0 sends them.
"""

from __future__ import annotations

from concurrent.futures import Future

from torch import nn

from posttrain.data.batch import RolloutBatch
from posttrain.models.lora import policy_weights
from posttrain.parallel.runtime import DistContext
from posttrain.parallel.shares import SINGLE_SHARE, DataShare, select_share
from posttrain.rl.collect.context import GeneratedStep
from posttrain.utils.metrics import PhaseTimer


class RolloutQueue:
    """A :class:`~posttrain.rl.collect.source.RolloutSource`: the queue of rollouts ahead of training, on a host that runs the rollout worker's calls in order
    (``posttrain.rl.overlap.hosts``: a thread, or a Ray actor)."""

    def __init__(
        self,
        host,
        max_staleness: int,
        start_step: int,
        total_steps: int,
        partial: bool = False,
        dist: DistContext | None = None,
        share: DataShare = SINGLE_SHARE,
    ):
        self.host = host  # None on ranks other than 0
        self.dist, self.share = dist or DistContext(), share
        self.max_staleness = max_staleness
        self.partial = partial  # rollouts in two calls: "start s" ahead, "finish s" when step s is taken
        self._total = total_steps
        self._pending: dict[int, Future] = {}  # step -> its GeneratedStep
        self._next = start_step + 1  # the next step to queue a rollout for
        self._loads: list[Future] = []  # weight loads not yet seen to have succeeded

    def take(self, step: int, timer: PhaseTimer | None = None) -> tuple[RolloutBatch, dict[str, float]]:
        """Step ``step``'s batch (this rank's share of it) and rollout metrics (waits for it, timed as
        ``rollout_wait``; queues the rollouts up to step + k). With partial rollouts its finish is queued first
        (after the newest weights), then the starts up to step + k."""
        with (timer or PhaseTimer()).phase("rollout_wait"):
            batch, metrics = self._from_main(self._take_here, step)
        return select_share(batch, self.share), metrics

    def _take_here(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
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
        # A sharded policy is gathered by every rank (a collective); rank 0 keeps the copy and sends it, the
        # other ranks drop each gathered tensor at once (never a whole copy of the model).
        keep = self.host is not None
        snapshot, nbytes = [], 0
        for name, t in policy_weights(policy):
            nbytes += t.numel() * t.element_size()
            if keep:
                snapshot.append((name, t.detach().clone()))
        if keep:
            self._loads.append(self.host.call("load", version, snapshot))
        return {"async/weights_mib": nbytes / 2**20}

    def validate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """Validate with the last pushed weights, after everything queued so far (every rank gets rank 0's
        metrics and rows)."""
        return self._from_main(lambda: self.host.call("validate", step).result())

    def drain(self) -> None:
        """Wait until every queued rollout and weight load has run (the engine is idle and holds the last
        pushed weights); rollouts already generated stay queued for their steps."""
        if self.host is not None:
            self.host.call("ready").result()
            self._check_loads()

    def sampler_state_after(self, step: int) -> dict:
        """The prompt sampler's state as the synchronous loop has it after step ``step`` (for a checkpoint):
        before the first rollout queued beyond ``step`` drew its prompts (the same on every rank)."""
        return self._from_main(self._sampler_state_here, step)

    def _sampler_state_here(self, step: int) -> dict:
        if step + 1 in self._pending:
            return self._pending[step + 1].result().sampler_before
        return self.host.call("sampler_state").result()

    def close(self) -> None:
        if self.host is not None:
            self.host.close()

    def _from_main(self, fn, *args):
        """``fn(*args)`` run on rank 0, its result sent to every rank. A failure there reaches the other ranks as
        an error with its message (instead of leaving them waiting for a result until the timeout)."""
        if not self.dist.distributed:
            return fn(*args)
        if self.host is not None:
            try:
                result = fn(*args)
            except BaseException as exc:
                self.dist.broadcast_object(_Failed(f"{type(exc).__name__}: {exc}"))
                raise
            return self.dist.broadcast_object(result)
        result = self.dist.broadcast_object(None)
        if isinstance(result, _Failed):
            raise RolloutOnMainFailed(
                f"rank {self.dist.rank}: the rollout worker failed on rank 0 ({result.message}); see rank 0's "
                "error above"
            )
        return result

    def _check_loads(self) -> None:
        """Raise the error of a weight load that failed (nobody waits on a load, so it would pass unseen)."""
        for fut in [f for f in self._loads if f.done()]:
            self._loads.remove(fut)
            fut.result()


class _Failed:
    """What rank 0 sends the other ranks when its call to the rollout worker failed."""

    def __init__(self, message: str):
        self.message = message


class RolloutOnMainFailed(RuntimeError):
    """On a rank other than 0: rank 0's call to the rollout worker failed (rank 0 raises the cause)."""
