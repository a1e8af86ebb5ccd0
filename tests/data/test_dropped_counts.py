"""Prompts over data.max_prompt_length are dropped with a visible count (SFT here; train and eval log through the
same helper), and reward failures show in the console step line when not zero."""

from rich.console import Console

from posttrain.data.records import PromptRecord
from posttrain.models.tiny import build_tiny_tokenizer
from posttrain.sft.loop import make_examples
from posttrain.utils.console import TrainingDisplay


def test_sft_counts_dropped_prompts(caplog):
    tok = build_tiny_tokenizer()
    records = [PromptRecord("1 + 1", "2"), PromptRecord("1 + 1 " * 50, "2"), PromptRecord("2 + 2", "4")]
    with caplog.at_level("WARNING", logger="posttrain"):
        examples = make_examples(records, tok, max_prompt_length=40, max_response_length=8)
    assert len(examples) == 2
    assert "1 of 3 SFT prompts are longer than data.max_prompt_length=40" in caplog.text


def test_reward_failures_in_the_step_line():
    display = TrainingDisplay(10, keys={"reward/mean": "reward"}, console=Console(), disable=True)
    line = display.format_line(
        1, {"reward/mean": 0.5, "reward/num_failures": 51.0, "reward/num_timeouts": 0.0}
    )
    assert "reward/num_failures 51" in line and "num_timeouts" not in line
    assert "num_failures" not in display.format_line(2, {"reward/mean": 0.5, "reward/num_failures": 0.0})
