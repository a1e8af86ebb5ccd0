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


def test_sft_validation_drops_overlong_prompts_with_a_count_and_writes_its_samples(
    tiny_model_dir, tmp_path, caplog
):
    from posttrain.models.hf import load_causal_lm, load_tokenizer
    from posttrain.sft.validation import SFTValidator
    from tests.helpers import sft_config

    cfg = sft_config(
        tiny_model_dir,
        tmp_path,
        "data.max_prompt_length=24",
        "data.max_response_length=4",
        "reward.function=exact_match",
    )
    records = [PromptRecord(f"What is {i} + 1?", str(i + 1), {}) for i in range(3)]
    records.append(PromptRecord("What is " + " + ".join(["1"] * 40) + "?", "40", {}))  # far over 24 tokens
    validator = SFTValidator(cfg, load_tokenizer(tiny_model_dir), records, "exact_match")
    assert validator.n_dropped == 1 and len(validator.records) == 3
    assert "1 of 4 SFT validation prompts are longer than data.max_prompt_length=24" in caplog.text
    metrics = validator(load_causal_lm(tiny_model_dir), step=5)
    assert set(metrics) == {"val/loss", "val/accuracy", "val/reward_mean"}
    lines = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [5, 5, 5]
    assert [row["ground_truth"] for row in lines] == ["1", "2", "3"]
    assert all({"prompt", "response", "reward"} <= set(row) for row in lines)
