"""The equivalence proof of exact token capture: the built-in calculator task's rows trained 2 GRPO steps natively
(``rollout.multi_turn``, ``env.path=calculator``) and through a harness written with only the ``openai`` package
(HARNESS below: it sends the calculator's tools schema, runs the calculator itself, appends the assistant message
as returned and the tool messages, calls again, returns None so the reward function scores the final messages)
samples the same ids with the same masks per sample, gets the same rewards on the same reward inputs, and ends
with the same weights, bit for bit. The engine's log-probs agree to 1e-5, not bit for bit: a token's log-prob
depends at float rounding (measured up to ~1e-6 here) on the batch its request is served in (the batch's width and
padding), and the gateway's batches form as HTTP calls arrive, not as the native loop's batcher forms them. The
sampled ids do not depend on it, and the trainer recomputes the log-probs it trains with.

The tiny random model never writes a tool call, so the rollout engine is the real native engine with one change
(``tool_calls_on_even_samples``): the FIRST turn of every even-numbered sample is a scripted calculator call (its
ids put in place of the sampled ones, the engine still runs); every other turn, the answers after the tool result
included, is sampled by the engine at its real position and noise. Both runs get the same engine.

Where the two paths can differ (none of which this harness does):
- the tool text: the harness's tool messages are rendered as sent; a harness whose calculator writes other text
  (another number format, other error messages) gives other tokens;
- tool output truncation: the native loop cuts tool results to rollout.multi_turn.max_tool_response_length tokens;
  the gateway renders the harness's tool messages as sent (the harness owns its context; a cut the harness does not
  know of would make the model read a tool result the harness never sent). Results here are a few tokens;
- a malformed ``<tool_call>`` block: the native environment answers it with an error tool message and continues;
  the gateway leaves it in the content (no call is invented), so an openai harness sees no tool call and stops;
- turn limits: the native loop stops after rollout.multi_turn.max_assistant_turns; the harness must stop there too
  (MAX_TURNS) and end on a refused call (budget spent: 400) as the native loop ends on its budget;
- any history the harness rewrites, or a tools list it changes, is rendered whole (a counted prefix break).
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.agents.builtin_envs import calculator
from posttrain.agents.hermes import tool_call_text
from posttrain.agents.tools import ToolSet, make_tool
from posttrain.data.tasks.calculator import make_calculator_splits
from posttrain.models.tiny import build_tiny_tokenizer
from posttrain.rl.collect.harness_loop import HarnessLoop
from posttrain.rl.collect.multi_turn import AgentLoop
from posttrain.rl.train_command import run_training
from posttrain.rollout.native.engine import NativeEngine
from tests.helpers import read_metrics, small_config

TOOLS = ToolSet([make_tool(calculator)]).schemas()
MAX_TURNS = 3

HARNESS = """
import ast
import json
import operator

import openai

TOOLS = json.loads(TOOLS_JSON)
MAX_TURNS = MAX_TURNS_VALUE
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def evaluate(node):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand)
    return OPS[type(node.op)](evaluate(node.left), evaluate(node.right))


def calculator(expression):
    value = evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def agent(row, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for turn in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError as exc:  # the trajectory's token budget is spent
            assert exc.code == "budget_exhausted", exc
            return None
        message = reply.choices[0].message
        if not message.tool_calls or turn == MAX_TURNS - 1:
            return None
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = calculator(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
""".replace("TOOLS_JSON", repr(json.dumps(TOOLS))).replace("MAX_TURNS_VALUE", str(MAX_TURNS))

REWARD = """
import json


def scored(prompt, response, ground_truth, extra):
    # Varies with the final answer and the number of tool results, so GRPO groups have signal.
    messages = extra["messages"]
    tools = sum(1 for m in messages if m["role"] == "tool")
    score = float(len(messages[-1]["content"] or "") % 3) + 0.5 * tools + float(ground_truth in response)
    with open(SCORES, "a") as f:  # what each sample was scored on, and its score
        f.write(json.dumps([prompt, response, messages[-1]["content"], tools, score]) + "\\n")
    return score
"""

COMMON = [
    "data.max_prompt_length=600",
    "data.max_response_length=112",
    "data.train_batch_size=2",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=2",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "actor.log_prob_micro_batch_size_per_gpu=8",
    "algorithm.adv_estimator=grpo",
]
NATIVE = [
    "rollout.multi_turn.enable=true",
    "env.path=calculator",
    "rollout.multi_turn.render_tools=true",
    f"rollout.multi_turn.max_assistant_turns={MAX_TURNS}",
]


def calculator_rows(path):
    """The calculator task's rows as a data file: a harness run refuses a multi-turn data.task (it would set
    env.path, which a harness replaces), so both runs read the same rows from this file."""
    train, _ = make_calculator_splits(seed=0, n_train=16, n_val=0)
    path.write_text("".join(json.dumps({"prompt": r.prompt, "answer": r.ground_truth}) + "\n" for r in train))
    return path


def tool_calls_on_even_samples(monkeypatch):
    """The native engine, with the first turn of every even sample replaced by a calculator call (see the module
    docstring); each scripted id's log-prob is -0.5. Every other call ends without eos (finish "stop", as a stop
    token other than eos ends a turn): both loops then close the turn with the eos the template ends it with."""
    tok = build_tiny_tokenizer()
    real = NativeEngine.generate_turns

    def generate_turns(self, requests, params):
        out = real(self, requests, params)
        for k, r in enumerate(requests):
            if r.position == 0 and r.sample_id % 2 == 0:
                text = tool_call_text("calculator", {"expression": f"{r.sample_id + 3} * 7"})
                eos = [tok.eos_token_id] if r.sample_id % 4 == 0 else []
                ids = (tok(text, add_special_tokens=False)["input_ids"] + eos)[: r.max_tokens]
                out.response_ids[k], out.response_logprobs[k] = ids, [-0.5] * len(ids)
                out.finish_reasons[k] = ("eos" if eos else "stop") if len(ids) < r.max_tokens else "length"
        return out

    monkeypatch.setattr(NativeEngine, "generate_turns", generate_turns)


def kept_rollouts(monkeypatch, loop_class) -> list:
    """Every RolloutResult the loop's ``generate`` returns during the run, in order."""
    kept, real = [], loop_class.generate

    def generate(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        kept.append(result)
        return result

    monkeypatch.setattr(loop_class, "generate", generate)
    return kept


def samples(results) -> list[tuple]:
    return [
        (e.sample_id, e.prompt_ids, e.response_ids, e.mask, e.logprobs, e.num_assistant_turns)
        for r in results
        for e in r.episodes
    ]


def weights(run_dir):
    return AutoModelForCausalLM.from_pretrained(run_dir / "final_model").state_dict()


def test_a_harness_trains_exactly_what_the_native_loop_trains(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "harness.py").write_text(HARNESS)
    tool_calls_on_even_samples(monkeypatch)
    rows = calculator_rows(tmp_path / "calculator.jsonl")
    common = [*COMMON, f"data.train_files=[{rows}]"]
    native, harness = tmp_path / "native", tmp_path / "harness"
    (tmp_path / "native_reward.py").write_text(
        REWARD.replace("SCORES", repr(str(tmp_path / "native.scores")))
    )
    native_results = kept_rollouts(monkeypatch, AgentLoop)
    reward = f"reward.function={tmp_path / 'native_reward.py'}:scored"
    run_training(small_config(tiny_model_dir, native, *common, *NATIVE, reward), quiet=True)
    (tmp_path / "harness_reward.py").write_text(
        REWARD.replace("SCORES", repr(str(tmp_path / "harness.scores")))
    )
    harness_results = kept_rollouts(monkeypatch, HarnessLoop)
    harness_file = f"harness.path={tmp_path / 'harness.py'}:agent"
    reward = f"reward.function={tmp_path / 'harness_reward.py'}:scored"
    run_training(small_config(tiny_model_dir, harness, *common, harness_file, reward), quiet=True)

    a, b = samples(native_results), samples(harness_results)
    assert len(a) == len(b) == 16
    called = {sample: turns for sample, *_, turns in a if turns > 1}
    assert {s % 4 for s in called} == {0, 2}, "no trajectory called the tool, with and without eos"
    for (*x, x_logprobs, x_turns), (*y, y_logprobs, y_turns) in zip(a, b):
        assert x == y and x_turns == y_turns  # sample id, prompt, response ids, mask: exactly
        assert x_logprobs == pytest.approx(
            y_logprobs, abs=1e-5, rel=0
        )  # batch-dependent rounding (docstring)
    scores = [sorted((tmp_path / f"{run}.scores").read_text().splitlines()) for run in ("native", "harness")]
    assert scores[0] == scores[1] and len(scores[0]) == 16
    for m, h in zip(read_metrics(native), read_metrics(harness)):
        for key in ("reward/mean", "reward/accuracy", "actor/loss", "actor/pg_loss"):
            assert m[key] == h[key], key
        assert h["gateway/prefix_breaks"] == 0.0 and h["gateway/harness_failures/raised"] == 0.0
    wa, wb = weights(native), weights(harness)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], w) for k, w in weights_of(tiny_model_dir).items())


def weights_of(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
