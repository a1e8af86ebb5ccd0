"""Rollouts ahead of training in a process of their own, placed by Ray (`async_training.rollout_worker=ray`):
the same samples, losses and gradients as the rollout thread, from another process; a resumed run starts the
worker from the trainer's weights and prompt order; a dead worker stops the run with a message that says
what is safe; missing Ray is a config error.

Ray is an optional extra (``posttrain[ray]``, part of ``[dev]``): CI installs it, so there these tests must
run; elsewhere they skip when it is missing."""

import os
import shutil
import sys

import pytest
import torch

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.data.sampler import PromptSampler
from posttrain.rl.build import check_run
from posttrain.rl.train_command import run_training
from posttrain.train.checkpoint import list_checkpoints
from tests.helpers import read_metrics, small_config
from tests.local_ray import local_ray

if os.environ.get("CI") != "true":
    pytest.importorskip("ray")
pytestmark = [pytest.mark.long, pytest.mark.timeout(600)]  # bounded; the fixture stops Ray

STEPS = ("trainer.total_steps=4", "trainer.export_hf=false")
COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")
RAY = ("async_training.enable=true", "async_training.rollout_worker=ray")


@pytest.fixture(scope="module")
def ray_instance(tmp_path_factory):
    """One local Ray instance for the module (a run joins it rather than starting its own), on loopback, gone
    with the module (tests/local_ray.py)."""
    with local_ray(tmp_path_factory.mktemp("ray"), num_cpus=2) as ray:
        yield ray


def _run(model_dir, run_dir, *extra):
    run_training(small_config(model_dir, run_dir, *STEPS, *extra), quiet=True)
    return read_metrics(run_dir)


def _fresh_sampler(cfg) -> dict:
    return PromptSampler(
        cfg.data.num_train_examples, cfg.data.train_batch_size, cfg.trainer.seed
    ).state_dict()


def test_a_ray_worker_samples_what_the_rollout_thread_samples(ray_instance, tiny_model_dir, tmp_path):
    """One step ahead, validation included: the worker process builds its own engine from the model
    directory, gets the trainer's weights after every update, and produces the same run."""
    extra = ("async_training.max_staleness=1", "trainer.test_freq=2")
    thread = _run(tiny_model_dir, tmp_path / "thread", "async_training.enable=true", *extra)
    ray = _run(tiny_model_dir, tmp_path / "ray", *RAY, *extra)
    assert [m["step"] for m in ray] == [0, 1, 2, 3, 4]
    for t, r in zip(thread, ray, strict=True):
        for key in (*COMPARED, "async/policy_version", "async/policy_lag_max", "val/accuracy"):
            assert (key in r) == (key in t), (t["step"], key)
            if key in t:
                assert r[key] == t[key], (t["step"], key)
    assert [m["async/policy_version"] for m in ray[1:]] == [0, 0, 1, 2]


def test_the_worker_runs_in_another_process(ray_instance, tiny_model_dir, tmp_path):
    from posttrain.rl.overlap.hosts import start_ray_host

    cfg = small_config(tiny_model_dir, tmp_path / "run", *RAY)
    host = start_ray_host(cfg, tiny_model_dir, 0, _fresh_sampler(cfg))
    try:
        assert host.remote and host.call("ready").result() != os.getpid()
    finally:
        host.close()
    assert ray_instance.util.placement_group_table() == {} or all(
        g["state"] == "REMOVED" for g in ray_instance.util.placement_group_table().values()
    )


def test_a_resumed_run_starts_the_worker_from_the_checkpoint(ray_instance, tiny_model_dir, tmp_path):
    """With staleness 0 the Ray worker runs the synchronous schedule. Resuming it from step 2 gives the
    synchronous run's steps 3 and 4, so the new worker got the checkpoint's weights and prompt order."""
    sync = _run(tiny_model_dir, tmp_path / "sync")
    run_dir = tmp_path / "ray"
    extra = (*RAY, "async_training.max_staleness=0", "trainer.save_freq=2")
    _run(tiny_model_dir, run_dir, *extra)
    shutil.rmtree(list_checkpoints(run_dir)[-1])  # as if the run had stopped after step 2
    _run(tiny_model_dir, run_dir, *extra)
    resumed = {m["step"]: m for m in read_metrics(run_dir)}  # the resumed run's lines come last
    for s in sync[2:]:
        for key in COMPARED:
            assert resumed[s["step"]][key] == s[key], (s["step"], key)


def test_a_dead_worker_stops_the_run_with_what_is_safe(ray_instance, tiny_model_dir, tmp_path):
    from posttrain.rl.overlap.hosts import RolloutWorkerLost, start_ray_host

    cfg = small_config(tiny_model_dir, tmp_path / "run", *RAY)
    host = start_ray_host(cfg, tiny_model_dir, 0, _fresh_sampler(cfg))
    try:
        ray_instance.kill(host._actor)
        with pytest.raises(RolloutWorkerLost, match="The last checkpoint is intact: run the same command"):
            host.call("generate", 1).result(timeout=60)
    finally:
        host.close()


def test_a_worker_that_cannot_be_built_says_so_and_leaves_nothing_behind(
    ray_instance, tiny_model_dir, tmp_path
):
    from posttrain.rl.overlap.hosts import RolloutWorkerLost, start_ray_host

    cfg = small_config(tiny_model_dir, tmp_path / "run", *RAY)
    with pytest.raises(
        RolloutWorkerLost, match=r"could not be built where Ray placed it .* nothing was trained"
    ):
        start_ray_host(cfg, tmp_path / "no-such-model", 0, _fresh_sampler(cfg))
    assert all(g["state"] == "REMOVED" for g in ray_instance.util.placement_group_table().values())


def test_ray_settings_are_checked_before_anything_loads(monkeypatch):
    cfg = build_config(overrides=["async_training.rollout_worker=ray"])
    with pytest.raises(
        ConfigError,
        match=r"rollout_worker=ray .* async_training.enable=false .*; set async_training.enable=true",
    ):
        check_run(cfg, 1, torch.device("cpu"))
    cfg.async_training.enable = True
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"Ray, which is not installed .* pip install 'posttrain\[ray\]'"):
        check_run(cfg, 1, torch.device("cpu"))


def test_explain_says_where_the_rollout_worker_runs():
    from rich.console import Console

    from posttrain.config.plan import build_plan
    from posttrain.planning.explain import plan_tree

    def text(*extra, world_size=1):
        cfg = build_config(overrides=["async_training.enable=true", *extra])
        console = Console(width=400, record=True)
        console.print(plan_tree(cfg, build_plan(cfg, world_size)))
        return console.export_text()

    ray = text(*RAY[1:], "async_training.rollout_num_gpus=1")
    assert "a process of its own that Ray places on 1 CPU(s) and 1 GPU(s)" in ray
    assert "queued for the Ray-placed worker process" in ray
    assert "sends each of the" not in ray
    assert "a background thread of the trainer's process" in text()
    ranks = text(*RAY[1:], world_size=2)
    assert "it generates whole steps for rank 0, which sends each of the 2 ranks its share" in ranks
