"""A task written exactly as verl's preprocessing scripts write it loads unchanged: nested keys by dotted path,
the layout recognised with no keys given, data_source and extra_info handed to a verl-style reward as verl
hands them."""

import json

import pytest

from posttrain.config.errors import DataError
from posttrain.data.datasets import load_records
from posttrain.data.fields import get_path, has_path, is_verl_row
from posttrain.rewards.functions import resolve_reward_function
from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, small_config

pa = pytest.importorskip("pyarrow")  # the data extra; the vLLM environment has none
pq = pytest.importorskip("pyarrow.parquet")

QUESTIONS = [
    ("What is 2 + 3?", "5"),
    ("What is 7 + 1?", "8"),
    ("What is 4 + 4?", "8"),
    ("What is 9 + 0?", "9"),
]


def verl_rows(split="train"):
    """Rows as verl's gsm8k preprocessing writes them (its column set and nesting)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": q + " Let's think step by step."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"split": split, "index": i, "answer": f"{q} #### {a}", "question": q},
        }
        for i, (q, a) in enumerate(QUESTIONS)
    ]


def write_verl_parquet(path, split="train"):
    pq.write_table(pa.Table.from_pylist(verl_rows(split)), path)
    return path


def test_dotted_paths_reach_nested_fields():
    row = verl_rows()[0]
    assert get_path(row, "reward_model.ground_truth") == "5"
    assert get_path(row, "extra_info.index") == 0
    assert has_path(row, "extra_info.question") and not has_path(row, "reward_model.nope")
    assert get_path({"a.b": 1, "a": {"b": 2}}, "a.b") == 1  # a top-level name with a dot wins
    assert is_verl_row(row) and not is_verl_row({"prompt": "x", "answer": "1"})


def test_verl_parquet_loads_with_no_keys_given(tmp_path, caplog):
    path = write_verl_parquet(tmp_path / "train.parquet")
    with caplog.at_level("INFO", logger="posttrain"):
        records = load_records(path)
    assert "verl's layout" in caplog.text and "reward_model.ground_truth" in caplog.text
    assert [r.ground_truth for r in records] == [a for _, a in QUESTIONS]
    assert records[0].prompt == [{"role": "user", "content": "What is 2 + 3? Let's think step by step."}]
    assert records[0].extra["data_source"] == "openai/gsm8k"
    assert records[0].extra["extra_info"]["question"] == "What is 2 + 3?"


def test_dotted_keys_for_prompt_and_answer(tmp_path):
    path = write_verl_parquet(tmp_path / "train.parquet")
    records = load_records(path, prompt_key="extra_info.question", answer_key="reward_model.ground_truth")
    assert records[1].prompt == "What is 7 + 1?" and records[1].ground_truth == "8"
    with pytest.raises(DataError, match=r"missing field 'reward_model.truth'.*reward_model.ground_truth"):
        load_records(path, answer_key="reward_model.truth")


def test_verl_reward_gets_verl_arguments(tmp_path):
    path = write_verl_parquet(tmp_path / "train.parquet")
    (tmp_path / "score.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return (data_source, solution_str, ground_truth, extra_info)\n"
    )
    fn = resolve_reward_function(f"{tmp_path / 'score.py'}:compute_score", "train")
    r = load_records(path)[2]
    assert fn(r.prompt, "8", r.ground_truth, r.extra) == (
        "openai/gsm8k",
        "8",
        "8",
        {"split": "train", "index": 2, "answer": "What is 4 + 4? #### 8", "question": "What is 4 + 4?"},
    )


SPY = """
import json, pathlib
def compute_score(data_source, solution_str, ground_truth, extra_info):
    with open(pathlib.Path(__file__).with_suffix(".jsonl"), "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
    return float(len(solution_str) % 3)
"""


@pytest.mark.parametrize(
    "keys", [[], ["data.prompt_key=prompt", "data.answer_key=reward_model.ground_truth"]]
)
def test_verl_parquet_trains(tiny_model_dir, tmp_path, keys):
    train = write_verl_parquet(tmp_path / "train.parquet")
    val = write_verl_parquet(tmp_path / "test.parquet", split="test")
    (tmp_path / "spy.py").write_text(SPY)
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"reward.function={tmp_path / 'spy.py'}:compute_score",
        "trainer.total_steps=1",
        *keys,
    )
    run_training(cfg, quiet=True)
    assert read_metrics(tmp_path / "run")[-1]["step"] == 1
    calls = [json.loads(line) for line in (tmp_path / "spy.jsonl").read_text().splitlines()]
    assert calls and all(c[0] == "openai/gsm8k" for c in calls)
    by_question = {c[3]["question"]: c for c in calls}
    assert by_question["What is 2 + 3?"][2] == "5"
    assert by_question["What is 2 + 3?"][3]["split"] in ("train", "test")


def test_the_verl_layout_is_said_in_one_line_the_user_sees(tmp_path):
    """Not an info record nobody sees: one warning line on stderr, however often the file is read (the checks
    read its first rows, the run all of them)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in verl_rows()))
    code = (
        "from posttrain.data.datasets import first_records, load_records\n"
        f"first_records({str(path)!r}); load_records({str(path)!r}); load_records({str(path)!r})"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    said = [line for line in done.stderr.splitlines() if "verl's layout" in line]
    assert said == [f"{path} is in verl's layout: the answers are read from reward_model.ground_truth"]
