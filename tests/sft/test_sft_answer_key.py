"""SFT validation scores against data.answer_key, not the worked response of sft.response_key."""

import json

from posttrain.config.load import build_config
from posttrain.data.records import PromptRecord
from posttrain.rewards.functions import resolve_reward_function
from posttrain.sft.validation import answer_of, sft_val_records


def test_sft_validation_compares_with_the_answer_field(tmp_path):
    rows = [{"question": "What is 40 + 6?", "solution": "40 + 6 = 46\n#### 46", "answer": "46"}]
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = build_config(
        overrides=[f"data.val_files=[{path}]", "data.prompt_key=question", "sft.response_key=solution"]
    )
    (record,) = sft_val_records(cfg, [])
    assert record.ground_truth == "40 + 6 = 46\n#### 46"  # the SFT target
    assert answer_of(record, cfg.data.answer_key) == "46"  # what the reward compares against
    assert resolve_reward_function("exact_match")("", "46", answer_of(record, "answer"), {}) == 1.0


def test_verl_rows_and_rows_without_an_answer():
    verl = PromptRecord("q", "worked", {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "7"}})
    assert answer_of(verl, "answer") == "7"
    assert answer_of(PromptRecord("q", "7", {}), "answer") == "7"
    assert answer_of(PromptRecord("q", "7", {"meta": {"gt": 8}}), "meta.gt") == "8"
