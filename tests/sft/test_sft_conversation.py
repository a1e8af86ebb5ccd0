"""`posttrain sft` on multi-turn conversations: tool calls, tool results and user replies, trained on the assistant
messages only, as the multi-turn rollout renders them."""

import json
import random

import pytest

from posttrain.agents.demos import calculator_demonstration, demonstrations, guess_number_demonstration
from posttrain.agents.render import Renderer
from posttrain.config.errors import DataError
from posttrain.data.datasets import load_records
from posttrain.data.records import PromptRecord
from posttrain.data.tasks import load_task
from posttrain.sft.conversation import conversation_example
from posttrain.sft.loop import make_examples


def _spans(tok, ids, mask):
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], tok.decode(ids[start:i])))
            start = i
    return out


def test_only_assistant_messages_are_trained_on(tok):
    train, _ = load_task("calculator", 0, n_train=4, n_val=0)
    row = calculator_demonstration(train[0], random.Random(0), no_tool_rate=0.0)
    a, b = train[0].extra["a"], train[0].extra["b"]
    prompt, response, mask = conversation_example(row["messages"], tok)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n") and f"{a} * {b}" in tok.decode(prompt)
    spans = _spans(tok, response, mask)
    assert [m for m, _ in spans] == [1, 0, 1]
    assert spans[0][1].startswith("<tool_call>") and spans[0][1].endswith("</tool_call><|im_end|>")
    assert (
        spans[1][1]
        == f"\n<|im_start|>user\n<tool_response>\n{a * b}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert spans[2][1] == f"{a * b}<|im_end|>"


def test_the_example_is_what_a_rollout_renders(tok):
    """Prompt and environment tokens equal the multi-turn driver's incremental rendering, and the whole example
    equals a full rendering of the conversation (no drift)."""
    train, _ = load_task(
        "guess_number", 0, n_train=4, n_val=0, high=31, max_turns=5
    )  # a game of several turns
    messages = guess_number_demonstration(train[1], random.Random(3), random_guess_rate=0.0)["messages"]
    prompt, response, mask = conversation_example(messages, tok)
    renderer = Renderer(tok)
    assert prompt == renderer.prompt_ids(messages[:1])
    first_env = mask.index(0)
    second_turn = mask.index(1, first_env)
    assert response[first_env:second_turn] == renderer.new_message_ids([messages[2]])
    assert not renderer.drift(messages, prompt + response).drifted
    turns = sum(1 for m in messages if m["role"] == "assistant")
    assert sum(1 for i, t in enumerate(response) if mask[i] and t == tok.eos_token_id) == turns


def test_make_examples_reads_conversation_rows(tok, tmp_path):
    train, _ = load_task("calculator", 1, n_train=8, n_val=0)
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in demonstrations("calculator", train, 8, seed=0)))
    records = load_records(path, "messages", "")
    examples = make_examples(records, tok, max_prompt_length=64, max_response_length=256)
    assert len(examples) == 8 and all(
        e.mask is not None and len(e.mask) == len(e.response_ids) for e in examples
    )
    # A record with a response keeps the old meaning: earlier assistant messages are few-shot context.
    few_shot = PromptRecord(prompt=[{"role": "user", "content": "1?"}, {"role": "assistant", "content": "1"},
                                    {"role": "user", "content": "2?"}], ground_truth="2")  # fmt: skip
    (example,) = make_examples([few_shot], tok, 64, 16)
    assert example.mask is None and tok.decode(example.response_ids) == "2<|im_end|>"


def test_a_row_without_a_response_nor_assistant_messages_is_an_error(tok):
    record = PromptRecord(
        prompt=[{"role": "user", "content": "hi"}], ground_truth=None, source="d.jsonl: row 0"
    )
    with pytest.raises(DataError, match="d.jsonl: row 0: the response is null.*conversation"):
        make_examples([record], tok, 64, 16)


def test_posttrain_sft_learns_the_assistant_turns_of_conversations(tiny_model_dir, tmp_path):
    """`posttrain sft` end to end on demonstration rows (data.prompt_key=messages, sft.response_key=''): it runs
    and the loss falls."""
    from posttrain.config.load import build_config
    from posttrain.sft.command import run_sft_command

    train, _ = load_task("guess_number", 1, n_train=16, n_val=0)
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in demonstrations("guess_number", train, 32, seed=0)))
    cfg = build_config(
        overrides=[
            f"model.path={tiny_model_dir}",
            f"trainer.run_dir={tmp_path / 'run'}",
            f"sft.train_files=[{path}]",
            "data.prompt_key=messages",
            "sft.response_key=",
            "data.max_prompt_length=96",
            "data.max_response_length=96",
            "sft.batch_size=8",
            "sft.micro_batch_size_per_gpu=8",
            "sft.epochs=2",
            "sft.optim.lr=3e-3",
            "trainer.test_freq=0",
        ]
    )
    out = run_sft_command(cfg, quiet=True)
    assert (out / "config.json").exists()
    losses = [
        json.loads(x)["sft/loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 8 and losses[-1] < losses[0]
