"""The training mask is visible: each multi-turn sample row (samples.jsonl, eval_samples.jsonl) carries its
response as the loss sees it, the trained runs (sampled assistant tokens) and the masked-out ones."""

import json

from posttrain.agents.builtin_envs import calculator
from posttrain.agents.driver import run_trajectories
from posttrain.agents.env import ToolEnvironment
from posttrain.agents.hermes import tool_call_text
from posttrain.agents.tools import ToolSet, make_tool
from posttrain.cli import main
from tests.helpers import multi_turn_settings, scripted, small_overrides


def test_spans_alternate_trained_assistant_turns_and_masked_tool_results(tok):
    def policy(conversation):
        return (
            "It is 408."
            if "<tool_response>" in conversation
            else tool_call_text("calculator", {"expression": "12*34"})
        )

    tools = ToolSet([make_tool(calculator)])
    [traj] = run_trajectories(
        [{"prompt": "12*34?"}],
        lambda r: ToolEnvironment(tools),
        scripted(tok, policy),
        tok,
        multi_turn_settings(),
    )
    spans = traj.trained_spans(tok)
    assert [s["trained"] for s in spans] == [True, False, True]
    assert "<tool_call>" in spans[0]["text"] and spans[0]["text"].endswith("<|im_end|>")
    assert (
        "408" in spans[1]["text"] and "<tool_response>" in spans[1]["text"]
    )  # the tool's answer: masked out
    assert spans[2]["text"].startswith("It is 408.")
    assert sum(s["tokens"] for s in spans if s["trained"]) == sum(traj.mask)
    assert sum(s["tokens"] for s in spans) == len(traj.response_ids)


def test_eval_samples_show_the_trained_spans(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    overrides = [
        *small_overrides(tiny_model_dir, run),
        "data.task=guess_number",
        "data.num_val_examples=2",
        "data.val_batch_size=2",
        "data.max_prompt_length=256",
        "data.max_response_length=24",
        "rollout.multi_turn.max_tokens_per_turn=4",
    ]
    assert main(["eval", *overrides]) == 0
    rows = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert rows and all(row["spans"] for row in rows)
    for row in rows:
        assert row["spans"][0]["trained"] is True  # the first assistant turn
        assert all(a["trained"] != b["trained"] for a, b in zip(row["spans"], row["spans"][1:]))
