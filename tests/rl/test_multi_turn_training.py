"""Multi-turn trajectories through the trainer: the token stream is the truth.

- one assistant turn and no tools is the single-turn path, bit for bit (batch, rewards, update);
- environment tokens have response_mask 0, their positions get exactly zero gradient, and the loss normaliser
  counts assistant tokens only;
- the trainer's recomputed log-probs of the assistant tokens match the engine's (native engine);
- a re-rendering that disagrees with the sampled tokens is counted (`multi_turn/template_drift`);
- per-turn reward placement, the trajectory metrics, and a GRPO run in an environment end to end;
- a tool's and an environment step's metrics reach the step's metrics as `env/<key>`.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.agents.builtin_envs import GuessNumberEnv
from posttrain.data.records import PromptRecord
from posttrain.forward.passes import policy_logprobs
from posttrain.models.hf import load_causal_lm
from posttrain.parallel.shares import ShareMetrics
from posttrain.rl.collect.generation import Scored, scored_batch
from posttrain.rl.collect.multi_turn import AgentLoop, episode_metrics
from posttrain.rl.train_command import run_training
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native.engine import NativeEngine
from tests.helpers import multi_turn_settings, read_metrics, response_logit_grads, small_config

MULTI_TURN = ["rollout.multi_turn.enable=true"]
GUESS = [*MULTI_TURN, "env.path=guess_number", "env.kwargs.max_turns=3", "data.max_response_length=24"]
GUESS += ["rollout.multi_turn.max_tokens_per_turn=4", "rollout.multi_turn.max_assistant_turns=3"]


def weights(run_dir):
    return AutoModelForCausalLM.from_pretrained(run_dir / "final_model").state_dict()


def test_one_turn_without_tools_is_the_single_turn_path_bit_for_bit(tiny_model_dir, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_training(small_config(tiny_model_dir, single), quiet=True)
    run_training(
        small_config(tiny_model_dir, multi, *MULTI_TURN, "rollout.multi_turn.max_assistant_turns=1"),
        quiet=True,
    )
    a, b = weights(single), weights(multi)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for ma, mb in zip(read_metrics(single), read_metrics(multi)):
        shared = [  # every metric both report, the engine's log-probs (rollout_corr/*) included
            k
            for k in ma
            if k in mb
            and not k.startswith(("timing/", "perf/", "reward/time_s", "reward/wait_s", "rollout/"))
        ]
        assert {k: ma[k] for k in shared} == {k: mb[k] for k in shared}
        assert mb["num_turns/mean"] == 1.0 and mb["tokens/environment"] == 0.0


def guess_trajectories(model, tokenizer, n=2, prompts=3, seed=5):
    engine = NativeEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    settings = multi_turn_settings(max_assistant_turns=3, max_tokens_per_turn=4, max_response_length=30)
    loop = AgentLoop(
        lambda row: GuessNumberEnv(max_turns=3), tokenizer, settings, "final", {tokenizer.eos_token_id}
    )
    records = [PromptRecord(f"Guess my number ({i}).", extra={"target": 40 + i}) for i in range(prompts)]
    return loop.generate(engine, records, SamplingParams(max_tokens=30, n=n, seed=seed))


def test_environment_tokens_are_context_with_zero_gradient(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir).float()
    result = guess_trajectories(model, tokenizer)
    assert any(0 in m for m in result.trainable_mask), "no trajectory got an environment reply"
    batch, grad, tokens = response_logit_grads(model, result, tokenizer.pad_token_id)
    mask = batch.response_mask
    width_p = batch.input_ids.shape[1] - mask.shape[1]
    env = (mask == 0) & (batch.attention_mask[:, width_p:] == 1)
    assert env.any() and torch.all(grad[env] == 0)
    assert grad[mask == 1].abs().sum() > 0
    # The normaliser counts assistant tokens only: the token-mean loss divides by them.
    assert tokens == sum(sum(m) for m in result.trainable_mask)


def test_trainer_log_probs_match_the_engine_on_assistant_tokens(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir).float()
    result = guess_trajectories(model, tokenizer, n=3)
    assert sum(e.num_assistant_turns for e in result.episodes) > len(result)  # several turns were sampled
    batch = scored_batch(Scored(result, torch.zeros(len(result))), [], tokenizer.pad_token_id, None, True)
    with torch.no_grad():
        trainer, _ = policy_logprobs(model, batch, temperature=1.0)
    on = batch.response_mask == 1
    assert torch.allclose(trainer[on], batch.rollout_log_probs[on], atol=1e-5, rtol=0)
    assert torch.all(batch.rollout_log_probs[~on] == 0)


def test_per_turn_rewards_sit_on_each_assistant_turn_end(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir).float()
    result = guess_trajectories(model, tokenizer)
    for e in result.episodes:  # give every turn a distinct reward
        e.turn_rewards = [float(t + 1) for t in range(len(e.turns))]
    totals = torch.tensor([sum(e.turn_rewards) + 0.5 for e in result.episodes])
    final = scored_batch(Scored(result, totals), [], tokenizer.pad_token_id, None, False)
    per_turn = scored_batch(Scored(result, totals), [], tokenizer.pad_token_id, None, False, "per_turn")
    assert torch.allclose(final.token_level_scores.sum(-1), per_turn.token_level_scores.sum(-1))
    for i, e in enumerate(result.episodes):
        ends = [end - 1 for start, end in e.turns if end > start]
        for t, end in enumerate(ends[:-1]):
            assert per_turn.token_level_scores[i, end] == t + 1
        assert per_turn.token_level_scores[i, ends[-1]] == e.turn_rewards[len(ends) - 1] + 0.5


def test_template_drift_is_counted_not_hidden(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir).float()
    result = guess_trajectories(model, tokenizer)
    loop = AgentLoop(lambda row: GuessNumberEnv(), tokenizer, multi_turn_settings(), "final")
    for episode in result.episodes:
        canonical = loop.drifted(episode)
        assert episode.metrics["template_drift"] == float(canonical)
        # Replace the sampled ids of the first turn by a non-canonical spelling of the same text: drift.
        start, end = episode.turns[0]
        text = tokenizer.decode(episode.response_ids[start:end], skip_special_tokens=True)
        spelled = [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
        if len(text) > 1 and spelled != episode.response_ids[start:end]:
            episode.response_ids[start:end] = spelled
            assert loop.drifted(episode)


def test_grpo_in_an_environment_reports_the_trajectory_metrics(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    run_training(
        small_config(tiny_model_dir, run, *GUESS, "rollout.multi_turn.turn_rewards=per_turn"), quiet=True
    )
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    for key in (
        "num_turns/mean",
        "num_turns/max",
        "tokens/assistant",
        "tokens/environment",
        "reward/env_mean",
        "multi_turn/template_drift",
        "truncated/share",
        "rollout/prefill_tokens",
        "rollout/prefill_reused_tokens",
        "actor/pg_loss",
    ):
        assert all(key in m for m in metrics), key
    assert max(m["num_turns/max"] for m in metrics) > 1
    assert max(m["rollout/prefill_reused_tokens"] for m in metrics) > 0  # later turns reuse their prefix


METERED = '''
from posttrain.agents.env import Environment, StepResult, ToolEnvironment
from posttrain.agents.hermes import tool_call_text
from posttrain.agents.tools import ToolOutput, ToolSet, make_tool


def measure(text: str) -> ToolOutput:
    """Measure a text.

    Args:
        text: the text.
    """
    return ToolOutput(text=str(len(text)), metrics={"measured_chars": float(len(text))})


class Metered(Environment):
    """One step: the measure tool runs on the turn's text (whatever the model wrote); the episode ends."""

    def __init__(self):
        self.tools = ToolEnvironment(ToolSet([make_tool(measure)]))

    async def step(self, text):
        measured = await self.tools.step(tool_call_text("measure", {"text": text}))
        return StepResult(done=True, metrics={**measured.metrics, "steps": 1.0})
'''


def test_a_tools_and_a_steps_metrics_reach_the_grpo_steps_metrics(tiny_model_dir, tmp_path):
    env_file = tmp_path / "metered.py"
    env_file.write_text(METERED)
    run = tmp_path / "run"
    # A turn cut at max_tokens_per_turn still gets its step (one that spends the trajectory budget does not).
    limits = ["rollout.multi_turn.max_tokens_per_turn=4", "data.max_response_length=16"]
    run_training(
        small_config(tiny_model_dir, run, *MULTI_TURN, *limits, f"env.path={env_file}:Metered"), quiet=True
    )
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["env/steps"] == 1.0 for m in metrics)  # one step per trajectory, a mean over trajectories
    assert all("env/measured_chars" in m for m in metrics)
    assert max(m["env/measured_chars"] for m in metrics) > 0


COMBINATIONS = {
    "lora": ["model.lora_rank=4", "model.lora_alpha=8"],
    "packed-dynamic": [
        "model.use_remove_padding=true",
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=96",
        "actor.log_prob_max_token_len_per_gpu=96",
    ],
    "rollouts-ahead": ["async_training.enable=true"],
    "dapo": [
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=seq_reward",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=4",
    ],
    "ppo-critic": ["algorithm.adv_estimator=gae"],
}


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_multi_turn_trains_with(tiny_model_dir, tmp_path, name):
    run = tmp_path / "run"
    run_training(small_config(tiny_model_dir, run, *GUESS, *COMBINATIONS[name]), quiet=True)
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["tokens/assistant"] > 0 and m["actor/pg_loss"] == m["actor/pg_loss"] for m in metrics)


def test_every_rank_logs_the_same_trajectory_metric_names(tiny_model_dir):
    """Ranks reduce metrics position by position: a rank with no trajectory (or trajectories that called no
    tool) must add the same names as one whose trajectories did everything."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    result = guess_trajectories(load_causal_lm(tiny_model_dir).float(), tokenizer)
    how = {"mean": "mean", "sum": "sum"}
    full, empty = ShareMetrics(), ShareMetrics()
    episode_metrics(result.episodes, full, how, len(result), ("calculator",))
    episode_metrics([], empty, how, 0, ("calculator",))
    assert sorted(full.values) == sorted(empty.values)
    assert "tool_call_counts/calculator" in full.values and full.values["num_turns/max"] > 1
