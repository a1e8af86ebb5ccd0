"""HarnessLoop: harness rollouts with the real openai client, the real gateway (posttrain.gateway.server.Gateway)
and the real native engine, behind the agent loop's interface."""

import sys
import time

import openai
import pytest

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.config.schema.harness import HarnessConfig
from posttrain.data.records import PromptRecord
from posttrain.gateway.assemble import PREFIX_BREAKS
from posttrain.gateway.harness import CallableHarness, CommandHarness, HarnessFailure
from posttrain.gateway.server import Gateway
from posttrain.models.tiny import build_tiny_model
from posttrain.parallel.shares import MEAN, SUM, ShareMetrics
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.collect import harness_loop
from posttrain.rl.collect.harness_loop import HARNESS_METRICS, HarnessLoop, build_rollout_loop
from posttrain.rl.collect.multi_turn import env_rewards, episode_metrics, score_weights
from posttrain.rl.collect.validation import _generate_and_score
from posttrain.rl.eval_command import run_eval_command
from posttrain.rl.train_command import run_training
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native.engine import NativeEngine
from tests.helpers import read_metrics, small_config


def chat(base_url, api_key, messages):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return reply.choices[0].message.content


def two_turns(row, base_url, api_key):
    """An agent that appends: ask, then follow up on its answer."""
    messages = [{"role": "user", "content": row["prompt"]}]
    answer = chat(base_url, api_key, messages)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
    chat(base_url, api_key, messages)
    return None


def rewriting(row, base_url, api_key):
    """An agent that rewrites its history between calls (it summarises the first exchange away)."""
    chat(base_url, api_key, [{"role": "user", "content": row["prompt"]}])
    chat(base_url, api_key, [{"role": "user", "content": "Summary: asked. Now answer."}])
    return {"reward": 0.7, "metrics": {"rewrites": 1}}


@pytest.fixture(scope="module")
def engine(tok):
    model = build_tiny_model(tok, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    return NativeEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)


def loop(tok, fn, **settings) -> HarnessLoop:
    harness = fn if isinstance(fn, CommandHarness) else CallableHarness(fn, fn.__name__)
    gateway = lambda backend: Gateway(backend, tok)  # noqa: E731
    return HarnessLoop(harness, HarnessConfig(**settings), tok, 64, 0, gateway, {tok.eos_token_id})


RECORDS = [PromptRecord("What is 2+2?", "4"), PromptRecord("Name a colour.", "red")]
PARAMS = SamplingParams(max_tokens=64, n=2, seed=3)
ONE = SamplingParams(max_tokens=64, n=1, seed=0)


def test_an_appending_harness_is_one_sample_per_trajectory_with_template_tokens_masked(tok, engine):
    agents = loop(tok, two_turns)
    opened = []
    result = agents.generate(
        engine, RECORDS, PARAMS, prompt_offset=1, on_sample=lambda k, s: opened.append(k)
    )
    agents.close()
    assert result.prompt_index == [0, 0, 1, 1] and sorted(opened) == [0, 1, 2, 3]
    for t in result.episodes:
        assert t.num_assistant_turns == 2 and t.num_user_turns == 1 and t.metrics[PREFIX_BREAKS] == 0.0
        (a0, a1), (b0, b1) = t.turns
        assert t.mask == [1] * a1 + [0] * (b0 - a1) + [1] * (b1 - b0)  # template and user tokens: mask 0
        assert all(lp == 0.0 for lp in t.logprobs[a1:b0]) and b0 > a1
        assert t.messages[-1]["role"] == "assistant" and t.messages[-2]["content"] == "Sure?"
    assert [t.sample_id for t in result.episodes] == [2, 3, 4, 5]  # (prompt_offset + i) * n + j
    assert result.prompt_ids == [t.prompt_ids for t in result.episodes]


@pytest.mark.filterwarnings("ignore:reward.timeout_s=0")
def test_a_rewriting_harness_is_a_counted_break_and_its_reward_replaces_the_score(tok, engine):
    agents = loop(tok, rewriting)
    result = agents.generate(engine, RECORDS[:1], ONE)
    t = result.episodes[0]
    assert t.metrics[PREFIX_BREAKS] == 1.0 and t.num_assistant_turns == 1 and set(t.mask) == {1}
    assert t.step_metrics == {"rewrites": 1.0}
    assert env_rewards(result) == [0.7] and score_weights(result) == [0.0]
    runner = RewardRunner(lambda prompt, response, truth, extra: 1.0, timeout_s=None)
    _, inputs, scores = _generate_and_score(engine, tok, runner, RECORDS[:1], None, ONE, 0, agents)
    agents.close()
    assert scores == [pytest.approx(0.7)]  # the reward function's 1.0 does not count
    assert inputs[0].extra["messages"][0]["content"] == "Summary: asked. Now answer."


def test_on_prefix_break_fail_and_failure_kinds_kept_as_stand_ins(tok, engine):
    def no_calls(row, base_url, api_key):
        return 1.0

    def raises(row, base_url, api_key):
        raise ValueError("tool crashed")

    for fn, kind, settings in [
        (rewriting, "prefix_break", {"on_prefix_break": "fail"}),
        (no_calls, "no_calls", {}),
        (raises, "raised", {}),
    ]:
        agents = loop(tok, fn, max_failures=4, **settings)
        result = agents.generate(engine, RECORDS, PARAMS)
        agents.close()
        assert all(set(t.mask) == {0} for t in result.episodes)  # nothing of a failed trajectory is trained
        metrics = ShareMetrics()
        episode_metrics(result.episodes, metrics, {"mean": MEAN, "sum": SUM}, 4, (), None, HARNESS_METRICS)
        assert metrics.values[f"gateway/harness_failures/{kind}"] == 4.0
        with pytest.raises(HarnessFailure, match="4 trajectories of 4 failed in their harness, more than "):
            loop(tok, fn, max_failures=3, **settings).generate(engine, RECORDS, PARAMS)


def test_the_first_failure_stops_the_run_naming_the_row(tok, engine):
    def raises(row, base_url, api_key):
        raise ValueError("tool crashed")

    with pytest.raises(HarnessFailure, match=r"harness 'raises' on row 7 \(sample \d\) raised ValueError"):
        loop(tok, raises).generate(engine, RECORDS[:1], PARAMS, row_ids=[7])


def test_the_command_form(tok, engine, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys\n"
        "import openai\n"
        "row = json.load(sys.stdin)\n"
        "client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment\n"
        "client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': row['prompt']}],"
        " max_tokens=4)\n"
        "print(json.dumps({'reward': 0.5}))\n"
    )
    agents = loop(tok, CommandHarness((sys.executable, str(script)), "agent.py"))
    result = agents.generate(engine, RECORDS[:1], ONE)
    agents.close()
    assert env_rewards(result) == [0.5] and result.episodes[0].num_assistant_turns == 1


def test_a_closed_loop_starts_a_new_gateway_and_a_finished_session_refuses_calls(tok, engine):
    urls = []

    def remember(row, base_url, api_key):
        urls.append((base_url, api_key))
        return two_turns(row, base_url, api_key)

    agents = loop(tok, remember)
    agents.generate(engine, RECORDS[:1], ONE)
    with pytest.raises(openai.BadRequestError, match="is closed; open a new one"):
        chat(*urls[0], [{"role": "user", "content": "late"}])
    agents.close()
    assert agents._gateway is None
    agents.generate(engine, RECORDS[:1], ONE)
    agents.close()


def test_the_builder_picks_the_harness_loop(tok, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.py").write_text("def agent(row, base_url, api_key):\n    return None\n")
    cfg = build_config(overrides=["harness.path=h.py:agent", "rollout.multi_turn.max_tokens_per_turn=8"])
    built = build_rollout_loop(cfg, tok)
    assert isinstance(built, HarnessLoop) and built.max_tokens_per_turn == 8
    assert build_rollout_loop(build_config(overrides=[]), tok) is None
    with pytest.raises(
        ConfigError, match="harness.path / harness.command need a rollout engine that runs turns"
    ):
        built.generate(object(), RECORDS, PARAMS)


def test_a_sync_harness_past_its_timeout_holds_up_no_other_trajectory(tok, engine):
    def stuck_on_the_first(row, base_url, api_key):
        if row["ground_truth"] == "4":
            time.sleep(4)  # a thread cannot be stopped: it runs on, the run does not wait for it
        return two_turns(row, base_url, api_key)

    agents = loop(tok, stuck_on_the_first, max_concurrent=1, timeout_s=1.0, max_failures=1)
    took = time.monotonic()
    result = agents.generate(engine, RECORDS, ONE)
    agents.close()
    assert time.monotonic() - took < 3.5
    assert result.episodes[0].metrics == {"gateway/harness_failures/timeout": 1.0}
    assert result.episodes[1].num_assistant_turns == 2


HARNESS_FILE = """
import openai


def agent(row, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        text = reply.choices[0].message.content or ""  # None when the model sampled no text (as vLLM's)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    return {"reward": float(len(text) % 2), "metrics": {"calls": 2}}
"""


def counted_gateway(monkeypatch) -> list[str]:
    """The run's gateway, counted; returns the list its starts and stops are written to."""
    served = []

    class Counted(Gateway):
        def __enter__(self):
            served.append("open")
            return super().__enter__()

        def __exit__(self, *exc):
            served.append("closed")
            return super().__exit__(*exc)

    monkeypatch.setattr(harness_loop, "Gateway", Counted)
    return served


def test_a_training_run_through_a_harness(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "h.py").write_text(HARNESS_FILE)
    served = counted_gateway(monkeypatch)
    run = tmp_path / "run"
    over = [f"harness.path={tmp_path / 'h.py'}:agent", "data.max_response_length=24", "trainer.test_freq=2"]
    run_training(small_config(tiny_model_dir, run, *over), quiet=True)
    logged = read_metrics(run)
    steps = [step for step in logged if "actor/loss" in step]
    assert len(steps) == 2 and served == ["open", "closed"]  # one endpoint for training and validation
    for step in steps:
        assert step["gateway/prefix_breaks"] == 0.0 and step["gateway/harness_failures/raised"] == 0.0
        assert step["env/calls"] == 2.0 and step["num_turns/mean"] == 3.0 and step["tokens/environment"] > 0
    assert logged[0]["val/num_turns_mean"] == 3.0 and "val/accuracy" in steps[-1]


def test_posttrain_eval_through_a_harness(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "h.py").write_text(HARNESS_FILE)
    served = counted_gateway(monkeypatch)
    over = [f"harness.path={tmp_path / 'h.py'}:agent", "data.max_response_length=24"]
    metrics = run_eval_command(small_config(tiny_model_dir, tmp_path / "run", *over), str(tiny_model_dir))
    assert metrics["val/num_turns_mean"] == 3.0 and served == ["open", "closed"]
