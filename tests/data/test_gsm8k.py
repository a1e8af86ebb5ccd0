"""GSM8K-format loading and the numeric verifier."""

import json

import pytest

from posttrain.data.tasks import load_task
from posttrain.data.tasks.gsm8k import GSM8K_INSTRUCTION, extract_final_answer, gsm8k_reward, load_gsm8k

ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 more than $300. Price?", "answer": "1200 + 300 = 1500\n#### $1,500"},
]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_jsonl(tmp_path):
    records = load_gsm8k(write(tmp_path / "g.jsonl", ROWS))
    assert [r.ground_truth for r in records] == ["7", "1500"]
    assert records[0].prompt == ROWS[0]["question"] + "\n" + GSM8K_INSTRUCTION
    assert records[1].extra["solution"] == ROWS[1]["answer"]
    assert load_gsm8k(tmp_path / "g.jsonl", instruction=None)[0].prompt == ROWS[0]["question"]


def test_load_parquet_and_task_registry(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    train, val = load_task(
        "gsm8k",
        seed=0,
        train_path=tmp_path / "train.parquet",
        val_path=write(tmp_path / "val.jsonl", ROWS[:1]),
    )
    assert [r.ground_truth for r in train] == ["7", "1500"]
    assert [r.ground_truth for r in val] == ["7"]


def test_answer_without_marker_names_file_row_field(tmp_path):
    path = write(tmp_path / "bad.jsonl", [ROWS[0], {"question": "q", "answer": "the answer is 5"}])
    with pytest.raises(
        ValueError, match=r"bad\.jsonl: row 1: field 'answer' does not end in '#### <number>'"
    ):
        load_gsm8k(path)


def test_missing_answer(tmp_path):
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 0 \(line 1\): missing field 'answer'"):
        load_gsm8k(write(tmp_path / "bad.jsonl", [{"question": "q"}]))


def test_extract_final_answer():
    assert extract_final_answer("work\n#### 1,234") == "1234"
    assert extract_final_answer("#### -3.5") == "-3.5"
    assert extract_final_answer("no marker 5") is None
    assert extract_final_answer("#### five") is None


@pytest.mark.parametrize(
    "response, expected",
    [
        ("So the total is 1500.\n#### 1500", 1.0),
        ("#### $1,500", 1.0),
        ("#### 1500.00<|im_end|>", 1.0),
        ("First 200, then 1300, so 1500 dollars.", 1.0),  # last number without '####'
        ("#### 1500 because 3 + 4", 1.0),  # first number after the marker
        ("The total is 1500. #### 150", 0.0),
        ("1500 is wrong, it is 1400", 0.0),
        ("no idea", 0.0),
        ("#### ", 0.0),
    ],
)
def test_gsm8k_reward(response, expected):
    assert gsm8k_reward("q", response, "1500", {}) == expected


def test_gsm8k_reward_needs_ground_truth():
    with pytest.raises(ValueError, match="needs a ground_truth"):
        gsm8k_reward("q", "5", None, {})
