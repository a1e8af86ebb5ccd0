"""A user's data file with a bad row: the error names the file, the row and the field (issue: a user's own task)."""

import json

import pytest

from posttrain.config.errors import DataError
from posttrain.data.datasets import load_records, tokenize_prompts
from posttrain.models.tiny import build_tiny_tokenizer


def write(path, rows):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    return path


def test_empty_prompt_names_file_row_and_field(tmp_path):
    path = write(tmp_path / "t.jsonl", [{"q": "fine", "answer": "1"}, {"q": "  ", "answer": "2"}])
    with pytest.raises(DataError, match=r"t\.jsonl: row 1 \(line 2\): field 'q': the prompt is empty"):
        load_records(path, prompt_key="q")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_non_utf8_bytes_name_file_row_and_field(tmp_path, suffix):
    good = b'{"prompt": "ok", "answer": "1"}'
    bad = b'{"prompt": "caf\xe9", "answer": "2"}'
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(good + b"\n" + bad + b"\n" if suffix == ".jsonl" else b"[" + good + b"," + bad + b"]")
    with pytest.raises(
        DataError, match=r"latin1\.jsonl?: row 1.*field 'prompt' is not valid UTF-8 \(byte 0xe9"
    ):
        load_records(path)


def test_overlong_prompt_error_names_file_row_and_field(tmp_path):
    path = write(
        tmp_path / "long.jsonl", [{"prompt": "hi", "answer": "1"}, {"prompt": "word " * 50, "answer": "2"}]
    )
    records = load_records(path)
    with pytest.raises(
        DataError,
        match=r"long\.jsonl: row 1 \(line 2\): field 'prompt': prompt is \d+ tokens.*overlong_prompts=error",
    ):
        tokenize_prompts(records, build_tiny_tokenizer(), max_prompt_length=16, overlong="error")
