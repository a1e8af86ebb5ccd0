"""The multi-turn driver: token layout and masks, turn and token limits, tools that do not block generation,
and a real tiny Qwen2 sampling through transformers' generate and through the native engine."""

import asyncio
import re
import time

import pytest
import torch

from posttrain.agents.builtin_envs import GuessNumberEnv, calculator
from posttrain.agents.driver import EnvironmentFailure, Generation, run_trajectories
from posttrain.agents.env import Environment, StepResult, ToolEnvironment
from posttrain.agents.hermes import tool_call_text
from posttrain.agents.render import Renderer
from posttrain.agents.tools import ToolSet, make_tool
from posttrain.agents.trajectory import trajectory_metrics
from posttrain.data.datasets import encode_prompt
from posttrain.models.tiny import build_tiny_model
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native.engine import NativeEngine
from tests.helpers import multi_turn_settings, scripted


def bisect(conversation: str) -> str:
    low, high = 1, 100
    for guess, hint in re.findall(
        r"assistant\n(\d+)<\|im_end\|>\n<\|im_start\|>user\n(Higher|Lower)", conversation
    ):
        low, high = (int(guess) + 1, high) if hint == "Higher" else (low, int(guess) - 1)
    return str((low + high) // 2)


def test_guess_number_layout_masks_turns_and_rewards(tok):
    rows = [{"target": t} for t in (1, 50, 77, 100)]
    settings = multi_turn_settings(max_assistant_turns=8, max_user_turns=8, max_response_length=400)
    trajs = run_trajectories(
        rows, lambda row: GuessNumberEnv(max_turns=7), scripted(tok, bisect), tok, settings
    )
    for traj, row in zip(trajs, rows):
        assert traj.finish_reason == "stop" and traj.reward == 1.0 and traj.metrics["solved"] == 1.0
        assert traj.messages[-1]["content"] == str(row["target"])
        assert len(traj.response_ids) == len(traj.mask) == len(traj.logprobs)
        for start, end in traj.turns:  # assistant turns are mask 1, end with eos; everything else is mask 0
            assert (
                traj.mask[start:end] == [1] * (end - start) and traj.response_ids[end - 1] == tok.eos_token_id
            )
        assert traj.assistant_tokens == sum(e - s for s, e in traj.turns)
        assert traj.num_user_turns == traj.num_assistant_turns - 1
        assert traj.turn_end_rewards()[traj.turns[-1][1] - 1] == 1.0
        assert Renderer(tok).drift(traj.messages, traj.prompt_ids + traj.response_ids).mismatched_tokens == 0
    assert [t.num_assistant_turns for t in trajs] == [6, 1, 7, 7]


def test_turn_limit_and_trajectory_budget(tok):
    row = [{"target": 100}]
    limited = run_trajectories(
        row,
        lambda r: GuessNumberEnv(),
        scripted(tok, bisect),
        tok,
        multi_turn_settings(max_assistant_turns=2),
    )[0]
    assert (
        limited.finish_reason == "turn_limit" and limited.num_assistant_turns == 2 and limited.reward == 0.0
    )
    users = run_trajectories(
        row, lambda r: GuessNumberEnv(), scripted(tok, bisect), tok, multi_turn_settings(max_user_turns=1)
    )[0]
    assert users.finish_reason == "turn_limit" and users.num_user_turns == 1
    for budget in (3, 20, 25, 30):
        short = run_trajectories(
            row,
            lambda r: GuessNumberEnv(),
            scripted(tok, bisect),
            tok,
            multi_turn_settings(max_response_length=budget),
        )[0]
        assert short.finish_reason == "length" and len(short.response_ids) <= budget
        assert "trajectory budget" in short.truncations


def calculator_policy(conversation: str) -> str:
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", conversation)
    if results:
        return f"The answer is {results[-1]}."
    a, b = re.findall(r"What is (\d+) \* (\d+)", conversation)[-1]
    return tool_call_text("calculator", {"expression": f"{a} * {b}"})


def test_calculator_tool_round_trip(tok):
    tools = ToolSet([make_tool(calculator)])
    rows = [{"prompt": f"What is {a} * {b}?"} for a, b in [(123, 456), (999, 1001)]]
    settings = multi_turn_settings(max_tool_response_length=32)
    trajs = run_trajectories(
        rows, lambda r: ToolEnvironment(tools), scripted(tok, calculator_policy), tok, settings
    )
    assert [t.messages[-1]["content"] for t in trajs] == ["The answer is 56088.", "The answer is 999999."]
    for t in trajs:
        assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
        assert t.metrics["tool_calls/calculator"] == 1.0 and t.metrics["tool_failures/raised"] == 0.0
        assert "<tools>" in tok.decode(t.prompt_ids)  # the tool schemas are in the prompt
        assert (
            Renderer(tok, tools.schemas()).drift(t.messages, t.prompt_ids + t.response_ids).drifted is False
        )


class SlowToolEnv(Environment):
    """Row 0's tool takes 1 s; the others answer at once."""

    def __init__(self, row):
        self.delay = row["delay"]

    async def step(self, text):
        if "again" in text:
            return StepResult(done=True)
        await asyncio.sleep(self.delay)
        return StepResult([{"role": "tool", "content": "ok"}])


def test_a_trajectory_waiting_for_its_tool_does_not_block_the_others(tok):
    rows = [{"prompt": "go", "delay": 1.0}] + [{"prompt": "go", "delay": 0.0}] * 3
    done_at = []

    def generate(requests):
        prompts = [r.ids for r in requests]
        done_at.append((time.perf_counter(), len(prompts)))
        text = [("again" if "tool_response" in tok.decode(p) else "call") for p in prompts]
        ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in text]
        return [Generation(i, [0.0] * len(i), "stop") for i in ids]

    start = time.perf_counter()
    trajs = run_trajectories(rows, SlowToolEnv, generate, tok, multi_turn_settings())
    assert all(t.num_assistant_turns == 2 for t in trajs)
    # the three fast trajectories' second turns were generated before the slow tool returned
    assert done_at[0][1] == 4 and done_at[1] == (done_at[1][0], 3) and done_at[1][0] - start < 0.9
    assert done_at[2][1] == 1


class Broken(Environment):
    def step(self, text):
        raise KeyError("no such state")


def test_an_environment_that_raises_names_itself_and_the_row(tok):
    with pytest.raises(EnvironmentFailure, match="Broken.step failed on row 1: KeyError"):
        run_trajectories(
            [{"prompt": "a"}, {"prompt": "b"}],
            lambda r: Broken() if r["prompt"] == "b" else Environment(),
            scripted(tok, lambda c: "x"),
            tok,
            multi_turn_settings(),
        )


def test_environment_failures_under_the_cap_are_kept_untrained_and_counted(tok):
    rows = [{"prompt": p} for p in "abcd"]
    make = lambda r: Broken() if r["prompt"] in "bd" else Environment()  # noqa: E731
    capped = multi_turn_settings(max_env_failures=2)
    trajs = run_trajectories(rows, make, scripted(tok, lambda c: "x"), tok, capped, row_ids=[10, 11, 12, 13])
    failed = [t for t in trajs if t.metrics.get("env_failures")]
    assert len(failed) == 2 and all(sum(t.mask) == 0 and t.reward == 0.0 for t in failed)
    assert "Broken.step failed on row 11" in failed[0].truncations[0]
    assert all(sum(t.mask) > 0 for t in trajs if t not in failed)
    with pytest.raises(EnvironmentFailure, match="2 trajectories of 4 failed .*max_env_failures=1"):
        run_trajectories(
            rows, make, scripted(tok, lambda c: "x"), tok, multi_turn_settings(max_env_failures=1)
        )


def hf_generate(model, tok):
    """transformers' generate behind the driver's callable: one prompt at a time, sampled, with the log-probs of
    the distribution it sampled from."""
    eos = {tok.eos_token_id, tok.pad_token_id}

    def generate(requests):
        prompts, limits = [r.ids for r in requests], [r.max_tokens for r in requests]
        out = []
        for ids, limit in zip(prompts, limits):
            with torch.no_grad():
                res = model.generate(
                    torch.tensor([ids]), max_new_tokens=limit, do_sample=True, output_scores=True,
                    return_dict_in_generate=True, temperature=1.0, top_k=0, top_p=1.0,
                    sequence_bias={(tok.eos_token_id,): 6.0},  # a random model: end turns early
                )  # fmt: skip
            new = res.sequences[0, len(ids) :].tolist()
            lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(res.scores, new)]
            out.append(Generation(new, lp, "stop" if new and new[-1] in eos else "length"))
        return out

    return generate


def test_with_a_real_tiny_qwen2(tok):
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    settings = multi_turn_settings(max_assistant_turns=3, max_tokens_per_turn=12, max_response_length=120)
    rows = [{"target": 5, "seed": i} for i in range(3)]
    trajs = run_trajectories(rows, lambda r: GuessNumberEnv(), hf_generate(model, tok), tok, settings)
    for t in trajs:
        assert t.finish_reason in ("stop", "length", "turn_limit") and len(t.response_ids) <= 120
        assert len(t.mask) == len(t.response_ids) == len(t.logprobs)
        assert all(lp <= 0.0 for lp, m in zip(t.logprobs, t.mask) if m == 1)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if m == 0)
        report = Renderer(tok).drift(t.messages, t.prompt_ids + t.response_ids)
        print(t.finish_reason, t.num_assistant_turns, "turns, drift", report.mismatched_tokens)
    assert any(t.num_assistant_turns > 1 for t in trajs)


def test_single_turn_is_the_one_step_case(tok):
    """No tools, the base environment: the prompt is the data pipeline's prompt and the response the sampled ids."""
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    traj = run_trajectories(
        [{"prompt": prompt}],
        lambda r: Environment(),
        scripted(tok, lambda c: "5"),
        tok,
        multi_turn_settings(),
    )[0]
    assert traj.prompt_ids == encode_prompt(prompt, tok, apply_chat_template=True)
    assert traj.response_ids == tok("5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert traj.mask == [1] * len(traj.response_ids) and traj.finish_reason == "stop"


def test_step_metrics_under_verl_and_trl_names(tok):
    tools = ToolSet([make_tool(calculator)])

    def policy(conversation):
        if "<tool_response>" in conversation:
            return "done"
        if "bad" in conversation:
            return tool_call_text("calculator", {"expression": "1/0"}) + tool_call_text("nope", {})
        return "no tool" if "plain" in conversation else tool_call_text("calculator", {"expression": "1+1"})

    rows = [{"prompt": "ok"}, {"prompt": "bad"}, {"prompt": "plain"}]
    trajs = run_trajectories(
        rows, lambda r: ToolEnvironment(tools), scripted(tok, policy), tok, multi_turn_settings()
    )
    m = trajectory_metrics(trajs)
    assert m["num_turns/min"] == 1.0 and m["num_turns/max"] == 3.0 and m["num_turns/mean"] == 7 / 3
    assert m["tool_call_counts/max"] == 2.0 and m["tools/call_frequency"] == 2 / 3
    assert m["tools/failure_frequency"] == 2 / 3
    assert m["tool_failures/raised"] == 1.0 and m["tool_failures/unknown_tool"] == 1.0
    assert m["truncated/share"] == 0.0
    assert m["tokens/assistant"] + m["tokens/environment"] == sum(len(t.response_ids) for t in trajs)
    assert m["tool_call_counts/calculator"] == 2 / 3 and m["tool_call_counts/nope"] == 1 / 3
    assert m["tools/latency_mean_s"] > 0 and m["env/step_time_mean_s"] > 0


def long_output(n: int) -> str:
    """Return n numbers."""
    return " ".join(str(i) for i in range(n))


def test_tool_output_is_truncated_in_tokens_and_logged(tok):
    tools = ToolSet([make_tool(long_output)])

    def policy(conversation):
        if "<tool_response>" in conversation:
            return "ok"
        return tool_call_text("long_output", {"n": 300}) + tool_call_text("long_output", {"n": 3})

    settings = multi_turn_settings(max_tool_response_length=32, tool_response_truncate_side="left")
    traj = run_trajectories(
        [{"prompt": "go"}], lambda r: ToolEnvironment(tools), scripted(tok, policy), tok, settings
    )[0]
    long, short = traj.messages[2]["content"], traj.messages[3]["content"]
    assert long.startswith("0 1 2") and long.endswith("...(truncated)...") and short == "0 1 2"
    assert len(tok(long, add_special_tokens=False)["input_ids"]) <= 32
    assert len(traj.truncations) == 1 and traj.truncations[0].startswith("tool output:")
    assert traj.truncations[0].endswith("tokens dropped (left)")


def test_an_engine_error_is_raised_not_swallowed(tok):
    def broken(requests):
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        run_trajectories(
            [{"prompt": "a"}, {"prompt": "b"}], lambda r: Environment(), broken, tok, multi_turn_settings()
        )


def native_generate(engine, seed=0):
    """The native engine behind the driver's callable: one engine call per distinct token limit."""
    calls = [0]

    def generate(requests):
        prompts, limits = [r.ids for r in requests], [r.max_tokens for r in requests]
        out: list = [None] * len(prompts)
        for limit in sorted(set(limits)):
            idx = [i for i, m in enumerate(limits) if m == limit]
            calls[0] += 1
            res = engine.generate(
                [prompts[i] for i in idx], SamplingParams(max_tokens=limit, seed=seed + calls[0])
            )
            for i, ids, lp, fin in zip(idx, res.response_ids, res.response_logprobs, res.finish_reasons):
                out[i] = Generation(ids, lp, "stop" if fin == "eos" else "length")
        return out

    return generate


def test_with_the_native_engine(tok):
    model = build_tiny_model(
        tok, hidden_size=64, num_hidden_layers=2, intermediate_size=128, tie_word_embeddings=False
    )
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Guess"}], add_generation_prompt=True, tokenize=False
    )
    with (
        torch.no_grad()
    ):  # a random model that ends its turns early: the eos row points along the mean hidden state
        h = model.model(torch.tensor([tok(prompt)["input_ids"]])).last_hidden_state[0].mean(0)
        model.lm_head.weight[tok.eos_token_id] = 6.0 * h / h.norm() ** 2
    engine = NativeEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    settings = multi_turn_settings(max_assistant_turns=3, max_tokens_per_turn=10, max_response_length=100)
    rows = [{"target": 5, "seed": i} for i in range(4)]
    trajs = run_trajectories(rows, lambda r: GuessNumberEnv(), native_generate(engine), tok, settings)
    for t in trajs:
        assert len(t.mask) == len(t.response_ids) == len(t.logprobs) and len(t.response_ids) <= 100
        for start, end in t.turns:
            assert t.mask[start:end] == [1] * (end - start)
        print(t.finish_reason, t.num_assistant_turns, "turns", t.assistant_tokens, "assistant tokens")
    assert any(t.num_assistant_turns > 1 for t in trajs)


def test_a_turn_ended_by_another_stop_token_is_closed_with_the_template_eos(tok):
    def generate(requests):
        prompts = [
            r.ids for r in requests
        ]  # ends every turn with <|endoftext|> (a stop token, but not the template's)
        ids = tok("7", add_special_tokens=False)["input_ids"] + [tok.pad_token_id]
        return [Generation(ids, [0.0] * len(ids), "stop") for _ in prompts]

    traj = run_trajectories(
        [{"target": 9}], lambda r: GuessNumberEnv(), generate, tok, multi_turn_settings()
    )[0]
    end = traj.turns[0][1]
    assert traj.response_ids[end - 1] == tok.pad_token_id and traj.response_ids[end] == tok.eos_token_id
    assert traj.mask[end] == 0


def test_each_trajectory_is_reported_when_it_ends(tok):
    """``on_done`` gets a trajectory as soon as its episode ends, while longer ones still generate turns."""
    rows = [{"target": t} for t in (1, 50, 77, 100)]
    settings = multi_turn_settings(max_assistant_turns=8, max_user_turns=8, max_response_length=400)
    engine_calls, reported = [], []
    policy = scripted(tok, bisect)

    def generate(requests):
        engine_calls.append(len(requests))
        return policy(requests)

    trajs = run_trajectories(
        rows,
        lambda row: GuessNumberEnv(max_turns=7),
        generate,
        tok,
        settings,
        on_done=lambda k, traj: reported.append((k, traj, len(engine_calls))),
    )
    assert sorted(k for k, _, _ in reported) == [0, 1, 2, 3]
    assert all(trajs[k] is traj for k, traj, _ in reported)
    first = reported[0]
    assert first[0] == 1 and first[2] == 1  # the one-turn episode, right after the first turn
    assert max(calls for _, _, calls in reported) == len(engine_calls) > 1
