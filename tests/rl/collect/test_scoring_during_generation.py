"""reward.score_during_generation: a step's samples scored while the step still generates give the same rewards,
metrics and weights as scoring them afterwards; scoring really starts before generation ends; a failing reward
still fails the step; ``auto`` scores during generation only where generation leaves the scoring CPUs free."""

import functools
import time
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config.load import build_config
from posttrain.rewards.code import CodeReward
from posttrain.rewards.runner import RewardFunctionError
from posttrain.rl.collect.phase import context_scorer, scoring_line
from posttrain.rl.train_command import run_training
from posttrain.rollout.native.engine import NativeEngine
from tests.helpers import read_metrics, small_config, untimed

REWARD = """
import time

def varied(prompt, response, ground_truth, extra):
    with open(CALLS, "a") as f:
        f.write(f"{time.monotonic()}\\n")
    if FAIL_ON and FAIL_ON in response:
        raise ValueError("the reward function failed on purpose")
    time.sleep(SLEEP)
    return float(len(response) % 3) + (1.0 if ground_truth and ground_truth in response else 0.0)

varied.samples_at_once = lambda: 2
"""
# Waves of 4 samples (one prompt of 4 samples at a time): the first wave finishes while the others generate.
WAVES = ["rollout.max_num_seqs=4", "rollout.max_num_batched_tokens=64"]


def reward_file(tmp_path, sleep=0.0, fail_on=""):
    path = tmp_path / "timed_reward.py"
    calls = tmp_path / "calls.txt"
    path.write_text(f"CALLS = {str(calls)!r}\nSLEEP = {sleep}\nFAIL_ON = {fail_on!r}\n" + REWARD)
    return path, calls


def run(tiny_model_dir, run_dir, *extra):
    run_training(small_config(tiny_model_dir, run_dir, *WAVES, *extra), quiet=True)
    return read_metrics(run_dir), AutoModelForCausalLM.from_pretrained(run_dir / "final_model").state_dict()


@pytest.mark.parametrize("timeout_s", [0, 60], ids=["in_process", "workers"])
def test_scoring_during_generation_changes_nothing_but_the_wait(tiny_model_dir, tmp_path, timeout_s):
    reward, _ = reward_file(tmp_path)
    common = (f"reward.function={reward}:varied", f"reward.timeout_s={timeout_s}")
    off, off_weights = run(tiny_model_dir, tmp_path / "off", *common, "reward.score_during_generation=never")
    on, on_weights = run(tiny_model_dir, tmp_path / "on", *common, "reward.score_during_generation=always")
    assert [untimed(m) for m in on] == [untimed(m) for m in off]
    assert all("reward/wait_s" in m for m in on + off)
    for name, tensor in off_weights.items():
        assert torch.equal(on_weights[name], tensor), name


def test_scoring_starts_before_generation_ends(tiny_model_dir, tmp_path, monkeypatch):
    reward, calls = reward_file(tmp_path, sleep=0.02)
    ends = []
    generate = NativeEngine.generate

    @functools.wraps(generate)
    def timed(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        ends.append(time.monotonic())
        return out

    monkeypatch.setattr(NativeEngine, "generate", timed)
    extra = (f"reward.function={reward}:varied", "trainer.total_steps=1", "reward.timeout_s=0")
    extra += (
        "data.max_response_length=16",
        "reward.score_during_generation=always",
    )  # the three later waves take 48 decode steps or so
    metrics, _ = run(tiny_model_dir, tmp_path / "run", *extra)
    called = sorted(float(t) for t in calls.read_text().split())
    assert len(ends) == 1 and len(called) == 16  # one generate call, 4 prompts x 4 samples
    assert called[0] < ends[0], "no sample was scored before generation ended"
    (step,) = metrics
    assert step["reward/wait_s"] <= step["reward/time_s"] + 0.05


@pytest.mark.timeout(300)
@pytest.mark.parametrize("timeout_s", [0, 60], ids=["in_process", "workers"])
def test_a_failing_reward_fails_the_step(tiny_model_dir, tmp_path, timeout_s):
    reward, _ = reward_file(tmp_path, fail_on=" ")  # any response with a space
    extra = (f"reward.function={reward}:varied", "reward.fail_fast=true", f"reward.timeout_s={timeout_s}")
    extra += ("reward.score_during_generation=always",)
    with pytest.raises(RewardFunctionError, match="failed on purpose"):
        run(tiny_model_dir, tmp_path / "run", *extra, "trainer.total_steps=1")


def test_multi_turn_trajectories_are_scored_as_they_end(tiny_model_dir, tmp_path):
    """Each trajectory is handed over when it ends (the environment's last step done): the same step."""
    reward, calls = reward_file(tmp_path)
    guess = ["rollout.multi_turn.enable=true", "env.path=guess_number", "env.kwargs.max_turns=3"]
    common = (
        f"reward.function={reward}:varied",
        "trainer.total_steps=1",
        "data.max_response_length=24",
        *guess,
    )
    off, off_weights = run(tiny_model_dir, tmp_path / "off", *common, "reward.score_during_generation=never")
    on, on_weights = run(tiny_model_dir, tmp_path / "on", *common, "reward.score_during_generation=always")
    assert [untimed(m) for m in on] == [untimed(m) for m in off]
    for name, tensor in off_weights.items():
        assert torch.equal(on_weights[name], tensor), name
    assert len(calls.read_text().split()) == 2 * 16


@pytest.mark.parametrize(
    ("device", "backend", "fn", "during"),
    [
        ("cpu", "local", CodeReward, False),  # the sandbox would slow the CPU rollout by more than it saves
        ("cuda", "local", CodeReward, True),  # a GPU rollout leaves the CPUs free
        ("cpu", "sandbox_fusion", CodeReward, True),  # the programs run on the sandbox hosts
        ("cuda", "local", lambda p, r, g, e: 0.0, False),  # a function without samples_at_once()
    ],
)
def test_auto_scores_during_generation_where_the_cpus_are_free(device, backend, fn, during):
    cfg = build_config(
        overrides=[f"sandbox.backend={backend}", "sandbox.sandbox_fusion.url=http://127.0.0.1:1"]
    )
    context = types.SimpleNamespace(
        cfg=cfg,
        reward_model=None,
        judge=None,
        prm=None,
        reward_runner=types.SimpleNamespace(fn=fn),
        tokenizer=None,
        generation_device=device,
    )
    assert context_scorer(context).during_generation is during
    line = scoring_line(cfg, device, fn)  # what `posttrain explain` prints
    assert line.startswith(f"scoring: {'during' if during else 'after'} generation (auto: "), line
    for when, forced in (("always", True), ("never", False)):
        cfg = build_config(overrides=[f"reward.score_during_generation={when}"])
        assert (
            context_scorer(types.SimpleNamespace(**{**vars(context), "cfg": cfg})).during_generation is forced
        )
