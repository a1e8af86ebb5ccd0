"""Where the rollout worker runs (`async_training.rollout_worker`): a background thread of the trainer's
process, or a process of its own placed by Ray, on its own CPUs or GPUs and possibly on another node.

A host runs the worker's calls one at a time, in the order they were made, and answers each with a
``concurrent.futures.Future``: a one-thread pool does that for the thread; a Ray actor does it for a process
(Ray runs the calls one caller makes on a one-at-a-time actor in submission order). That order is what makes
the rollouts-ahead schedule exact (``posttrain.rl.overlap.queue``), whichever host runs it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.parallel.ray_local import start_or_join
from posttrain.rl.checks import require_ray
from posttrain.rl.overlap.worker import ProcessRolloutWorker, RolloutWorker

log = logging.getLogger("posttrain")

PLACEMENT_TIMEOUT_S = 300  # how long Ray may take to find the rollout worker's CPUs/GPUs before we give up


class RolloutWorkerLost(RuntimeError):
    """The rollout worker's process died (killed, out of memory, its node gone) or could not be built."""

    def __init__(self, message: str, ray_says: str = ""):
        super().__init__(message)
        self.ray_says = ray_says


class ThreadHost:
    """The worker on a background thread of this process (it shares this process's devices)."""

    remote = False

    def __init__(self, worker: RolloutWorker):
        self._worker = worker
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-rollout")

    def call(self, method: str, *args) -> Future:
        return self._pool.submit(getattr(self._worker, method), *args)

    def close(self) -> None:
        # The worker's engine and reward runner are the trainer's own: the trainer closes them.
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayHost:
    """The worker as a Ray actor in a placement group of one bundle (its CPUs and GPUs)."""

    remote = True

    def __init__(self, ray, actor, group, started_ray: bool):
        self._ray, self._actor, self._group, self._started = ray, actor, group, started_ray

    def call(self, method: str, *args) -> Future:
        return _lost_as_error(getattr(self._actor, method).remote(*args).future(), self._ray)

    def close(self) -> None:
        ray = self._ray
        try:
            ray.get(self._actor.close.remote(), timeout=60)
        except Exception as exc:  # a dead worker has nothing left to close
            log.warning("the rollout worker did not close cleanly: %s", exc)
        ray.kill(self._actor)
        ray.util.remove_placement_group(self._group)
        if self._started:
            ray.shutdown()


def _lost_as_error(fut: Future, ray) -> Future:
    """``fut``, with Ray's "actor died" turned into :class:`RolloutWorkerLost` and a message that says what
    is safe (errors raised inside the worker keep their own type: Ray re-raises them as subclasses)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(f.result())
        except ray.exceptions.RayActorError as exc:
            says = f"Ray says: {exc}"
            out.set_exception(
                RolloutWorkerLost(
                    "the rollout worker's process died; the run stops here. The last checkpoint is intact: "
                    f"run the same command to resume from it. {says}",
                    says,
                )
            )
        except BaseException as exc:
            out.set_exception(exc)

    fut.add_done_callback(done)
    return out


def start_ray_host(cfg: PostTrainConfig, model_path: Path, version: int, sampler_state: dict) -> RayHost:
    """Join (or start) Ray, reserve the rollout worker's resources and build the worker there; returns once
    it is built (its errors surface here)."""
    ray = require_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    a = cfg.async_training
    started = start_or_join(ray, cfg.trainer.ray_address)  # a local start listens on loopback only
    gpus = {"GPU": a.rollout_num_gpus} if a.rollout_num_gpus else {}
    bundle = {"CPU": a.rollout_num_cpus} | gpus | a.rollout_resources
    group = placement_group([bundle], strategy="PACK", name="posttrain-rollout")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise ConfigError(
            f"Ray could not place the rollout worker ({bundle}) within {PLACEMENT_TIMEOUT_S} s; the cluster "
            f"has {ray.available_resources()} free. Lower async_training.rollout_num_cpus / rollout_num_gpus / "
            "rollout_resources, or add nodes"
        ) from None
    worker = ray.remote(ProcessRolloutWorker).options(
        num_cpus=a.rollout_num_cpus,
        num_gpus=a.rollout_num_gpus,
        resources=a.rollout_resources,
        max_restarts=0,  # a restarted worker would have lost its queue: the run stops instead (see docs)
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group),
        # A world of one whatever the trainer's: Ray's processes inherit the environment of the rank that
        # started Ray (torchrun's RANK/WORLD_SIZE), which would make the worker's engine act as that rank.
        runtime_env={
            "env_vars": {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        },
    )
    actor = worker.remote(
        cfg, str(model_path), version, sampler_state, a.rollout_num_cpus, a.rollout_num_gpus
    )
    host = RayHost(ray, actor, group, started)
    try:
        pid = host.call("ready").result()
    except RolloutWorkerLost as exc:
        host.close()  # its placement group, and the Ray instance started here
        raise RolloutWorkerLost(
            f"the rollout worker could not be built where Ray placed it ({bundle}); nothing was trained. "
            "It builds from the same model directory, data files and reward as the trainer, at the same paths: "
            f"check they are readable there. {exc.ray_says}"
        ) from None
    node = host.call("node_id").result()  # as the worker finds itself
    log.info("rollout worker started by Ray (process %d on node %s, %s)", pid, node, bundle)
    return host
