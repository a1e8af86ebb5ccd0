"""Prompts over data.max_prompt_length are dropped with a visible count (SFT here; train and eval log through the
same helper), and reward failures show in the console step line when not zero."""

import pytest
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


def test_sft_counts_truncated_targets(caplog):
    """A target longer than data.max_response_length is cut (losing its EOS): counted in one warning line that
    names the key, and in the per-step metric sft/truncated_share."""
    tok = build_tiny_tokenizer()
    records = [
        PromptRecord("1 + 1", "2"),
        PromptRecord("spell", "one two three four five"),
        PromptRecord("3", "3"),
    ]
    with caplog.at_level("WARNING", logger="posttrain"):
        examples = make_examples(records, tok, max_prompt_length=40, max_response_length=3)
    assert [e.truncated for e in examples] == [False, True, False]
    assert len(examples[1].response_ids) == 3 and examples[1].response_ids[-1] != tok.eos_token_id
    assert "1 of 3 SFT targets are longer than data.max_response_length=3 tokens" in caplog.text
    assert "raise data.max_response_length" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain"):
        make_examples(records, tok, max_prompt_length=40, max_response_length=64)
    assert "targets" not in caplog.text


def test_sft_steps_report_their_share_of_truncated_targets(tiny_model_dir, tmp_path):
    """sft/truncated_share: per step, the share of its targets that were cut; absent from runs that cut none."""
    from posttrain.data.datasets import load_records
    from posttrain.models.hf import load_causal_lm, load_tokenizer
    from posttrain.sft.loop import run_sft
    from tests.helpers import sft_config

    tok = load_tokenizer(tiny_model_dir)
    shares = {}
    for limit in (2, 8):  # targets "1".."16" and EOS: 2 to 3 tokens
        cfg = sft_config(tiny_model_dir, tmp_path, "sft.max_steps=2", f"data.max_response_length={limit}")
        records = load_records(cfg.sft.train_files[0], "prompt", "response")
        cut = sum(e.truncated for e in make_examples(records, tok, 64, limit)) / len(records)
        history = run_sft(cfg, load_causal_lm(tiny_model_dir), tok, records, quiet=True)
        assert len(history) == 2  # 16 targets, 8 a step: the first epoch, every target once
        shares[limit] = [h.get("sft/truncated_share") for h in history]
        if limit == 2:
            assert 0 < cut < 1 and sum(shares[limit]) / 2 == pytest.approx(cut)
    assert shares[8] == [None, None]
