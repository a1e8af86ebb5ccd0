"""Trainer ranks placed and restarted by Ray (`trainer.ray_ranks`): what torchrun does, on a Ray cluster.

`posttrain train trainer.ray_ranks=N` is the driver: it checks the launch, reserves N placement-group bundles
(`ray_cpus_per_rank` CPUs, `ray_gpus_per_rank` GPUs and `ray_resources_per_rank` each,
`ray_placement` strategy), starts one actor per
bundle, hands each the torch.distributed environment torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT of rank 0's node) and has it call ``run_training`` in its process. Rank 0
prints as usual; Ray forwards its output. The driver waits on all ranks at once, so the first failure is
seen at once: it then stops every rank, and either starts all of them again from the last checkpoint
(`ray_max_restarts`) or stops with a message saying which rank failed and that the checkpoint is intact.

A rank's process imports torch with this module, before its environment is set: it sets its thread count
explicitly, and CUDA reads CUDA_VISIBLE_DEVICES at its first use (in the trainer, after the environment is
set), not at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import time

import torch

from posttrain.config.errors import ConfigError
from posttrain.config.plan import build_plan
from posttrain.config.schema import PostTrainConfig
from posttrain.parallel.ray_local import start_or_join
from posttrain.parallel.rendezvous import loopback_gloo_env
from posttrain.parallel.runtime import launched_world_size
from posttrain.rl.checks import check_async_training, require_ray
from posttrain.rl.train_command import run_training
from posttrain.utils.run_lock import RunDirLock
from posttrain.utils.signals import Terminated

# Set in each rank's environment: that process trains, it does not ask Ray for ranks again.
MARKER = "POSTTRAIN_RAY_RANK"
PLACEMENT_TIMEOUT_S = (
    300  # how long Ray may take to find the ranks' CPUs/GPUs (and start them) before we give up
)
LOG_FLUSH_S = 1.0  # how long the driver waits for Ray to forward the ranks' last output lines
LOCK_WAIT_S = 60  # how long a restart waits for the failed rank 0's process (and its run_dir lock) to go
WAIT_POLL_S = 0.5  # how often the driver looks up from waiting on the ranks (signals are handled then)
USER_ERROR_GRACE_S = 10.0  # after a rank fails, how long the driver looks for a config error among the others


class RanksFailed(RuntimeError):
    """A rank died or raised and no restart is left; the message says which, why, and what is safe."""


class _RankLost(Exception):
    def __init__(self, rank: int, what: str):
        super().__init__(f"rank {rank} {what}")
        self.rank = rank


class _StopRequests:
    """Ctrl-C and SIGTERM on the driver: noted by the handler, acted on between two waits. (An exception
    raised by a handler while Ray waits is held inside Ray's wait until the ranks end, and then surfaces as
    a SystemError.)"""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():  # handlers live on the main thread only
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, frame: object) -> None:
        self.signum = signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def check(self) -> None:
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum == signal.SIGTERM:
            raise Terminated(
                "terminated (SIGTERM); the ranks were stopped and the last complete checkpoint is intact"
            )


def wants_ray_ranks(cfg: PostTrainConfig) -> bool:
    """Whether `posttrain train` should launch the ranks on Ray (not when this process is one of them)."""
    return cfg.trainer.ray_ranks > 0 and MARKER not in os.environ


class TrainerRank:
    """One trainer rank, a Ray actor in a process of its own (the process ends with the actor)."""

    def __init__(self, rank: int):
        self.rank = rank

    def __repr__(self) -> str:  # Ray prefixes the rank's forwarded output with this
        return f"rank {self.rank}"

    def where(self) -> tuple[str, str, list[str]]:
        """(node id, node IP, the GPU ids Ray gave this rank)."""
        import ray

        gpus = [str(g) for g in ray.get_gpu_ids()]
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), gpus

    def free_port(self) -> int:
        """A port free on this rank's node address (where rank 0 will listen)."""
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def train(self, cfg: PostTrainConfig, env: dict[str, str]) -> dict[str, float]:
        os.environ.update(env)
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # torch was loaded before the variable was set
        return run_training(cfg)


def check_launch(cfg: PostTrainConfig):
    """The rules on the launch itself, before Ray starts; returns the ray module. (The config-only rules of
    the ray_* keys are in posttrain.config.validate.)"""
    n, world = cfg.trainer.ray_ranks, launched_world_size()
    if world > 1:
        raise ConfigError(
            f"trainer.ray_ranks={n} has Ray start the trainer ranks, but this process is already one of "
            f"{world} ranks (WORLD_SIZE={world}: launched by torchrun?); run `posttrain train` once, without "
            "torchrun, or set trainer.ray_ranks=0 to train on torchrun's ranks"
        )
    build_plan(cfg, n)  # a batch plan that does not divide over N ranks fails here, not on every rank
    check_async_training(cfg, n)
    try:
        return require_ray()
    except ConfigError:
        raise ConfigError(
            f"trainer.ray_ranks={n} has Ray start the trainer ranks, but Ray is not installed; pip install "
            "'posttrain[ray]', or set trainer.ray_ranks=0 (and launch several ranks with torchrun)"
        ) from None


def run_on_ray(cfg: PostTrainConfig) -> dict[str, float]:
    """Train on `trainer.ray_ranks` Ray-placed ranks; returns rank 0's final metrics.

    Raises ConfigError (a user error, also one raised inside a rank: never restarted) or RanksFailed.
    """
    ray = check_launch(cfg)
    t = cfg.trainer
    started = start_or_join(ray, t.ray_address)  # a local start listens on loopback only
    stop = _StopRequests().install()  # Ctrl-C and SIGTERM stop the ranks on the way out
    try:
        attempt = 0
        while True:
            try:
                return _attempt(ray, cfg, attempt, stop)
            except _RankLost as lost:
                if attempt >= t.ray_max_restarts:
                    raise RanksFailed(
                        f"{lost} (the first rank to fail; the others were stopped). The last complete "
                        f"checkpoint in {t.run_dir} is intact: run the same command to resume from it"
                        + (f" (after {attempt} restart(s))" if attempt else "")
                    ) from None
                attempt += 1
                print(
                    f"{lost}; restarting {t.ray_ranks} ranks from the last checkpoint "
                    f"(restart {attempt} of {t.ray_max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
                _wait_for_run_dir(t.run_dir, stop)
                cfg = _resuming(cfg)
    finally:
        stop.restore()
        # Ray forwards the ranks' output from their log files every so often: let it pass the last lines.
        time.sleep(LOG_FLUSH_S)
        if started:
            ray.shutdown()


def _resuming(cfg: PostTrainConfig) -> PostTrainConfig:
    """The config of a restart: resume from the latest checkpoint in run_dir, whatever `resume` named."""
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="auto"))


def _wait_for_run_dir(run_dir: str, stop: _StopRequests) -> None:
    """Wait until no process holds run_dir's lock: a killed rank 0's process may take a moment to end, and
    the new rank 0 must take the lock (the kernel frees a dead process's lock)."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            RunDirLock(run_dir).acquire().release()
            return
        except ConfigError:
            if time.monotonic() > deadline:
                return  # the new rank 0 then says who holds it
            time.sleep(0.2)
            stop.check()


def _attempt(ray, cfg: PostTrainConfig, attempt: int, stop: _StopRequests) -> dict[str, float]:
    """Place and start the ranks once, wait for them; the placement group and actors are gone on return."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    t = cfg.trainer
    n, cpus, gpus, custom = t.ray_ranks, t.ray_cpus_per_rank, t.ray_gpus_per_rank, t.ray_resources_per_rank
    bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {}) | custom
    group = placement_group([bundle] * n, strategy=t.ray_placement, name=f"posttrain-trainer-{attempt}")
    actors = []
    try:
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        while not ray.wait([group.ready()], timeout=WAIT_POLL_S)[0]:
            stop.check()
            if time.monotonic() < deadline:
                continue
            raise ConfigError(
                f"Ray could not place {n} trainer ranks ({bundle} each, trainer.ray_placement="
                f"{t.ray_placement}) within {PLACEMENT_TIMEOUT_S} s; the cluster has "
                f"{ray.available_resources()} free. Lower trainer.ray_ranks / ray_cpus_per_rank / "
                "ray_gpus_per_rank, choose a looser trainer.ray_placement, or add nodes"
            )
        rank_class = ray.remote(TrainerRank)
        for i in range(n):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
            options = dict(num_cpus=cpus, num_gpus=gpus, resources=custom, max_restarts=0)
            actors.append(rank_class.options(**options, scheduling_strategy=strategy).remote(i))
        places = _gather(ray, [a.where.remote() for a in actors], stop)
        port = _gather(ray, [actors[0].free_port.remote()], stop)[0]
        envs = rank_envs(places, port, cpus, attempt)
        nodes = sorted({f"{ip} (node {node})" for node, ip, _ in places})  # as each rank found itself
        print(
            f"Ray placed {n} trainer ranks ({bundle} each, {t.ray_placement}) on {', '.join(nodes)}; "
            f"rank 0 listens on {envs[0]['MASTER_ADDR']}:{port}",
            flush=True,
        )
        return _wait(ray, [a.train.remote(cfg, env) for a, env in zip(actors, envs, strict=True)], stop)
    finally:
        for actor in actors:  # a rank still in a collective with a dead peer would wait for dist_timeout_s
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)


def _gather(ray, refs: list, stop: _StopRequests) -> list:
    """The answers of the ranks' setup calls; a rank whose process could not start counts as lost. (Starting
    a rank's process can take minutes on a busy machine: Ctrl-C and SIGTERM are acted on meanwhile.)"""
    deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_POLL_S)
        stop.check()
    answers = []
    for rank, ref in enumerate(refs):
        try:
            answers.append(ray.get(ref, timeout=0 if ref in pending else None))
        except ray.exceptions.RayError as exc:
            raise _RankLost(rank, f"could not start where Ray placed it ({_first_line(exc)})") from None
    return answers


def rank_envs(places: list[tuple[str, str, list[str]]], port: int, cpus: int, attempt: int) -> list[dict]:
    """Each rank's torchrun-style environment. LOCAL_RANK is its index among the ranks on its node; with
    GPUs every rank of a node sees the node's ranks' GPUs in that order, so LOCAL_RANK selects its own."""
    by_node: dict[str, list[int]] = {}
    for rank, (node, _, _) in enumerate(places):
        by_node.setdefault(node, []).append(rank)
    envs = []
    for rank, (node, _, gpus) in enumerate(places):
        mates = by_node[node]
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(places)),
            "LOCAL_RANK": str(mates.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(mates)),
            "MASTER_ADDR": places[0][1],
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(cpus),
            MARKER: str(attempt),
        } | loopback_gloo_env(places[0][1])  # Ray started here: every rank on loopback
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(places[m][2][0] for m in mates)
        # The driver's own POSTTRAIN_* settings (the model cache, ...) hold on every node.
        env |= {k: v for k, v in os.environ.items() if k.startswith("POSTTRAIN_") and k != MARKER}
        envs.append(env)
    return envs


def _wait(ray, refs: list, stop: _StopRequests) -> dict[str, float]:
    """Rank 0's result once every rank has finished; the first failure, as soon as it happens."""
    results: dict[int, dict] = {}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=WAIT_POLL_S)
        stop.check()
        if not done:
            continue
        rank = refs.index(done[0])
        try:
            results[rank] = _result(ray, rank, done[0])
        except _RankLost:
            # A user error on one rank makes its peers fail too (their group is gone), and on a busy machine
            # their failure may come first: a config error among the failures of the next moments wins.
            deadline = time.monotonic() + USER_ERROR_GRACE_S
            while pending and time.monotonic() < deadline:
                late, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_POLL_S)
                stop.check()
                for ref in late:
                    with contextlib.suppress(_RankLost):
                        _result(ray, refs.index(ref), ref)
            raise
    return results[0]


def _result(ray, rank: int, ref) -> dict:
    """A finished rank's result; its user error as a ConfigError, any other failure as _RankLost."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, ConfigError):  # a user error: starting again would fail the same way
            raise ConfigError(f"trainer rank {rank}: {cause}") from None
        raise _RankLost(rank, f"failed: {type(cause).__name__}: {_first_line(cause)}") from None
    except ray.exceptions.RayError as exc:  # the process died: killed, out of memory, its node lost
        raise _RankLost(rank, f"died ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(exc).__name__
