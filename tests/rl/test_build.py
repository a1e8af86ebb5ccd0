"""The one builder: `train` and `eval` build the reward runner alike, and the trainer owns the rollout engine's
memory: its cache is resident in the rollout phase only, as the memory estimate counts it."""

import pytest

from posttrain.config.plan import build_plan
from posttrain.parallel.runtime import DistContext
from posttrain.planning.memory import estimate_memory
from posttrain.planning.shape import ModelShape
from posttrain.rl import build, step
from posttrain.rl.build import build_components
from posttrain.rl.eval_command import run_eval_command
from posttrain.utils.metrics import PhaseTimer
from tests.helpers import small_config

GUARDS = ["reward.timeout_s=5", "reward.failure_reward=-1", "reward.fail_fast=true"]


def _recording_runner(monkeypatch):
    seen = []
    real = build.RewardRunner

    def record(fn, **kwargs):
        seen.append(kwargs)
        return real(fn, **kwargs)

    monkeypatch.setattr(build, "RewardRunner", record)
    return seen


def test_eval_and_train_build_the_same_reward_runner(tiny_model_dir, tmp_path, monkeypatch):
    seen = _recording_runner(monkeypatch)
    cfg = small_config(tiny_model_dir, tmp_path / "run", *GUARDS)
    build_components(cfg, quiet=True).close()
    run_eval_command(cfg, model_path=str(tiny_model_dir))
    assert len(seen) == 2 and seen[0] == seen[1]
    assert seen[0] == {"timeout_s": 5.0, "failure_reward": -1.0, "fail_fast": True}


def _kv_bytes(engine) -> int:
    cache = engine.cache
    return 0 if cache.k is None else sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v])


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_engine_cache_is_resident_in_the_rollout_phase_only(tiny_model_dir, tmp_path, monkeypatch, estimator):
    """Measured during one step: the KV cache exists while generating and is freed before the forward and
    update phases; the estimate counts a KV cache in the rollout phase only, at least as large as what the
    engine allocated."""
    cfg = small_config(tiny_model_dir, tmp_path / "run", f"algorithm.adv_estimator={estimator}")
    run = build_components(cfg, quiet=True, dist=DistContext())
    resident: dict[str, list[int]] = {"rollout": [], "forward": [], "update": []}
    generate, forward, update = run.engine.generate, step.forward_in_micro_batches, step.run_update

    def watch(phase, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            resident[phase].append(_kv_bytes(run.engine))
            return out

        return wrapped

    monkeypatch.setattr(run.engine, "generate", watch("rollout", generate))
    monkeypatch.setattr(step, "forward_in_micro_batches", watch("forward", forward))
    monkeypatch.setattr(step, "run_update", watch("update", update))
    step.train_step(run, 1, PhaseTimer())
    run.close()
    assert resident["rollout"] and min(resident["rollout"]) > 0
    assert resident["forward"] and set(resident["forward"]) == {0}
    assert resident["update"] and set(resident["update"]) == {0}
    estimate = estimate_memory(cfg, build_plan(cfg), ModelShape.from_hf_config(run.actor.module.config))
    assert max(resident["rollout"]) <= estimate.phase("rollout").part("KV cache")
    for phase in estimate.phases:
        if phase.phase != "rollout":
            assert phase.part("KV cache") == 0, phase.phase
