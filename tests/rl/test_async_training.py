"""Rollouts ahead of training (`async_training`): staleness 0 is the synchronous loop exactly, a fixed seed
reproduces a run, each sample's policy version and lag are what the schedule says, the lag is seen and
corrected by the rollout correction, and a checkpoint resumes the prompt order of the synchronous loop."""

import json

import pytest
import torch

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.config.plan import build_plan
from posttrain.rl.build import check_run
from posttrain.rl.train_command import run_training
from posttrain.train.checkpoint import list_checkpoints
from tests.helpers import read_metrics, small_config

STEPS = ("trainer.total_steps=4", "trainer.export_hf=false")
COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")


def _run(model_dir, run_dir, *extra):
    run_training(small_config(model_dir, run_dir, *STEPS, *extra), quiet=True)
    return read_metrics(run_dir)


def test_staleness_zero_is_the_synchronous_loop(tiny_model_dir, tmp_path):
    sync = _run(tiny_model_dir, tmp_path / "sync")
    ahead = _run(
        tiny_model_dir, tmp_path / "ahead", "async_training.enable=true", "async_training.max_staleness=0"
    )
    for s, a in zip(sync, ahead, strict=True):
        for key in COMPARED:
            assert a[key] == s[key], (s["step"], key)
        assert a["async/policy_lag_max"] == 0.0 and a["async/policy_version"] == s["step"] - 1


@pytest.mark.parametrize("staleness", [1, 2])
def test_lag_follows_the_schedule_and_a_seed_reproduces_the_run(tiny_model_dir, tmp_path, staleness):
    extra = ("async_training.enable=true", f"async_training.max_staleness={staleness}")
    first = _run(tiny_model_dir, tmp_path / "a", *extra)
    again = _run(tiny_model_dir, tmp_path / "b", *extra)
    sync = _run(tiny_model_dir, tmp_path / "sync")
    for m, r in zip(first, again, strict=True):
        for key in (*COMPARED, "async/policy_version", "async/policy_lag_max"):
            assert m[key] == r[key], (m["step"], key)
    for m in first:
        step = m["step"]
        # Rollout s was queued right after the weights of update s-1-k: lag min(s-1, k).
        assert m["async/policy_version"] == max(0, step - 1 - staleness)
        assert m["async/policy_lag_max"] == m["async/policy_lag_mean"] == min(step - 1, staleness)
    # The first rollouts use the initial weights, as the synchronous first step does; later ones are stale.
    assert first[0]["reward/mean"] == sync[0]["reward/mean"]
    assert any(m["reward/mean"] != s["reward/mean"] for m, s in zip(first[1:], sync[1:]))


def test_the_lag_is_measured_and_importance_weighted(tiny_model_dir, tmp_path):
    """The engine's log-probs come from an older policy than the trainer's: the mismatch shows from the first
    stale step on, and the truncated importance weights of the rollout correction move off 1."""
    extra = ("algorithm.rollout_correction.rollout_is=token", "actor.optim.lr=1e-2")
    sync = _run(tiny_model_dir, tmp_path / "sync", *extra)
    stale = _run(tiny_model_dir, tmp_path / "stale", *extra, "async_training.enable=true")
    for m in sync:  # on-policy: the engine's and the trainer's log-probs agree up to rounding
        assert m["rollout_corr/log_prob_abs_diff_mean"] < 1e-4
    assert stale[0]["rollout_corr/log_prob_abs_diff_mean"] < 1e-4  # step 1: lag 0
    for m in stale[1:]:
        assert m["async/policy_lag_max"] == 1
        assert m["rollout_corr/log_prob_abs_diff_mean"] > 1e-3
        assert abs(m["rollout_corr/rollout_is_mean"] - 1.0) > 1e-4


def test_a_checkpoint_keeps_the_prompt_order_of_the_synchronous_loop(tiny_model_dir, tmp_path):
    save = ("trainer.save_freq=2",)
    _run(tiny_model_dir, tmp_path / "sync", *save)
    _run(
        tiny_model_dir,
        tmp_path / "ahead",
        *save,
        "async_training.enable=true",
        "async_training.max_staleness=2",
    )
    for run in ("sync", "ahead"):
        assert [p.name for p in list_checkpoints(tmp_path / run)] == ["step_000002", "step_000004"]

    def sampler(run):
        ckpt = list_checkpoints(tmp_path / run)[0]
        return json.loads((ckpt / "trainer_state.json").read_text())["sampler"]

    assert sampler("ahead") == sampler("sync")


def test_a_rollout_thread_beside_several_ranks_is_refused_before_loading(tiny_model_dir, tmp_path):
    cfg = small_config(tiny_model_dir, tmp_path / "run", "async_training.enable=true")
    assert build_plan(cfg, 2).max_policy_lag >= 0
    with pytest.raises(
        ConfigError, match=r"rollout_worker=thread needs one trainer process, but the world size is 2"
    ):
        check_run(cfg, 2, torch.device("cpu"))


def test_each_row_records_the_version_that_sampled_it():
    """The queue alone, with a stand-in worker on the thread host: rollout s is generated after the load of
    version s-1-k, on the worker's thread."""
    import threading

    from posttrain.data.batch import build_rollout_batch
    from posttrain.rl.collect.context import GeneratedStep
    from posttrain.rl.overlap.hosts import ThreadHost
    from posttrain.rl.overlap.queue import RolloutQueue

    loaded, seen, threads = [], [], set()

    class Worker:
        version = 0

        def generate(self, step):
            threads.add(threading.current_thread().name)
            seen.append((step, list(loaded)))
            batch = build_rollout_batch([[1, 2]] * 3, [[3]] * 3, [0, 0, 0], pad_token_id=0)
            batch.policy_versions = torch.full((3,), self.version)
            return GeneratedStep(batch, {}, {})

        def load(self, version, weights):
            loaded.append(version)
            self.version = version

        def ready(self):
            return 0

    k, policy = 2, torch.nn.Linear(2, 2)
    ahead = RolloutQueue(ThreadHost(Worker()), k, start_step=0, total_steps=6)
    try:
        for step in range(1, 7):
            batch, metrics = ahead.take(step)
            assert batch.policy_versions.tolist() == [max(0, step - 1 - k)] * 3
            assert metrics["async/policy_lag_max"] == min(step - 1, k)
            ahead.push(step, policy)
        ahead.drain()
    finally:
        ahead.close()
    assert [s for s, _ in seen] == [1, 2, 3, 4, 5, 6]
    assert [len(versions) for _, versions in seen] == [0, 0, 0, 1, 2, 3]
    assert loaded == [1, 2, 3, 4, 5, 6]
    assert threads and threading.current_thread().name not in threads


def test_a_failed_weight_load_is_raised_not_lost():
    """Nobody waits on a weight load; its error surfaces at the next take or drain."""
    from posttrain.rl.overlap.hosts import ThreadHost
    from posttrain.rl.overlap.queue import RolloutQueue

    class Worker:
        def load(self, version, weights):
            raise RuntimeError(f"cannot load version {version}")

        def ready(self):
            return 0

    ahead = RolloutQueue(ThreadHost(Worker()), 1, start_step=0, total_steps=2)
    try:
        ahead.push(1, torch.nn.Linear(2, 2))
        with pytest.raises(RuntimeError, match="cannot load version 1"):
            ahead.drain()
    finally:
        ahead.close()


def test_async_training_with_an_unmerged_vllm_adapter_is_refused():
    from posttrain.rl.checks import check_async_training

    cfg = build_config(
        overrides=[
            "async_training.enable=true",
            "rollout.name=vllm",
            "model.lora_rank=8",
            "model.lora_merge=false",
        ]
    )
    with pytest.raises(
        ConfigError, match=r"model.lora_merge=false sends vLLM the adapter alone; set model.lora_merge"
    ):
        check_async_training(cfg, 1)
    cfg.model.lora_merge = True
    check_async_training(cfg, 1)  # merged snapshots are whole tensors: accepted
