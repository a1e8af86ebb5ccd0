"""Bad data is refused at load, before any model loads: exit 2 with a message naming file, row and key.

Drills (before: each was accepted, or failed with a library's traceback): preference pairs with NaN or
infinite margins, implicit-prompt pairs whose conversations do not share a prompt, a chosen reply given as a
user message, a truncated or non-parquet ``.parquet`` file, and a JSON error that read "at at column".
"""

import json

import pytest

from posttrain.cli import main
from posttrain.config.errors import DataError
from posttrain.config.load import build_config
from posttrain.data.datasets import load_records
from posttrain.rm.data import load_pairs

GOOD = {"prompt": "p", "chosen": "c", "rejected": "r", "margin": 1.0}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def write_jsonl(path, rows):
    # allow_nan: the drill's files hold NaN / Infinity as Python's json writes them
    path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
    return path


def rm_cfg(*overrides):
    return build_config(overrides=list(overrides))


@pytest.mark.parametrize("margin", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_margin_names_file_row_and_key(tmp_path, margin):
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD, {**GOOD, "margin": margin}])
    with pytest.raises(DataError) as info:
        load_pairs(rm_cfg("rm.margin_key=margin"), [str(path)])
    message = str(info.value)
    assert str(path) in message and "row 1" in message and "'margin'" in message and "finite" in message


def test_implicit_pairs_must_share_their_prompt(tmp_path):
    ok = {"chosen": [user("2+2?"), assistant("4")], "rejected": [user("2+2?"), assistant("5")]}
    apart = {"chosen": [user("2+2?"), assistant("4")], "rejected": [user("Write a poem"), assistant("5")]}
    path = write_jsonl(tmp_path / "implicit.jsonl", [ok, apart])
    with pytest.raises(DataError) as info:
        load_pairs(rm_cfg(), [str(path)])
    message = str(info.value)
    assert str(path) in message and "row 1" in message and "share their prompt" in message
    assert len(load_pairs(rm_cfg(), [str(write_jsonl(tmp_path / "ok.jsonl", [ok]))])) == 1


def test_implicit_text_pairs_must_begin_alike(tmp_path):
    rows = [
        {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"},
        {"chosen": "2+2 is 4", "rejected": "Tell me"},
    ]
    with pytest.raises(DataError, match="row 1.*share no beginning"):
        load_pairs(rm_cfg(), [str(write_jsonl(tmp_path / "texts.jsonl", rows))])


@pytest.mark.parametrize("prompt", ["2+2?", None])
def test_a_reply_in_a_user_message_is_refused(tmp_path, prompt):
    row = {"chosen": [user("4")], "rejected": [assistant("5")]}
    if prompt is None:
        row = {"chosen": [user("2+2?"), user("4")], "rejected": [user("2+2?"), assistant("5")]}
    else:
        row["prompt"] = prompt
    path = write_jsonl(tmp_path / "roles.jsonl", [GOOD, row])
    with pytest.raises(DataError) as info:
        load_pairs(rm_cfg(), [str(path)])
    message = str(info.value)
    assert "row 1" in message and "'chosen'" in message and "'user'" in message and "assistant" in message


@pytest.mark.parametrize("damage", ["truncated", "not_parquet"])
def test_a_damaged_parquet_file_is_a_data_error(tmp_path, damage):
    import datasets

    path = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list([GOOD] * 4).to_parquet(str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b'{"prompt": "p"}\n')
    with pytest.raises(DataError, match="not a readable parquet file") as info:
        load_pairs(rm_cfg(), [str(path)])
    assert str(path) in str(info.value)
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_records(path)


def test_a_control_character_in_jsonl_is_named_once(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a\tb", "answer": "1"}\n')  # a raw tab inside a JSON string
    with pytest.raises(DataError) as info:
        load_records(path)
    message = str(info.value)
    assert "at at" not in message and "Invalid control character (column" in message and "row 0" in message


def test_rm_exits_2_on_bad_pairs_before_any_model_loads(tmp_path, capsys):
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD, {**GOOD, "margin": float("inf")}])
    code = main(
        [
            "rm",
            f"data.train_files=[{path}]",
            "rm.margin_key=margin",
            "model.path=/nonexistent/model",  # never reached: the data is checked first
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "row 1" in err and "Traceback" not in err
