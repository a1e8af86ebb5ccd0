"""Prompt file loading (every format, malformed rows) and prompt tokenization."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from posttrain.config.errors import DataError
from posttrain.data.datasets import load_records, tokenize_prompts
from posttrain.data.records import PromptRecord

ROWS = [
    {"prompt": "what is one plus two", "answer": "3", "source": "a"},
    {"prompt": [{"role": "user", "content": "what is two plus two"}], "answer": 4, "source": "b"},
]

WORDS = "what is one two three plus four five six seven eight nine ten".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS plus the chat-template markers."""
    specials = ["<pad>", "<unk>", "<user>", "<assistant>", "<end>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def check_rows(records):
    assert records == [
        PromptRecord("what is one plus two", "3", {"source": "a"}),
        PromptRecord([{"role": "user", "content": "what is two plus two"}], "4", {"source": "b"}),
    ]


def test_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with path.open("a") as f:
        f.write("\n")  # a trailing blank line is not a row
    check_rows(load_records(path))


def test_json_list(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(ROWS))
    check_rows(load_records(path))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {"prompt": [{"role": "user", "content": "what is one plus two"}], "answer": "3", "source": "a"},
        {
            "prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
            "answer": "4",
            "source": "b",
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    records = load_records(tmp_path / "p.parquet")
    assert [r.prompt for r in records] == [row["prompt"] for row in rows]
    assert [r.extra for r in records] == [{"source": "a"}, {"source": "b"}]


def test_saved_dataset_dir_and_custom_keys(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(
        [{"question": "q1", "solution": "7", "id": 0}, {"question": "q2", "solution": "8", "id": 1}]
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    records = load_records(tmp_path / "saved", prompt_key="question", answer_key="solution")
    assert records == [PromptRecord("q1", "7", {"id": 0}), PromptRecord("q2", "8", {"id": 1})]


def test_saved_dataset_dict_names_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    split = datasets.Dataset.from_list([{"prompt": "p"}])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="several splits.*train"):
        load_records(tmp_path / "dd")


def test_missing_answer_is_an_error_unless_answers_are_optional(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "answer": "a"}, {"prompt": "hi"}])
    with pytest.raises(DataError, match=r"p\.jsonl: row 1 \(line 2\): missing field 'answer'.*answer_key=''"):
        load_records(path)
    records = load_records(path, answer_key="")
    assert [r.ground_truth for r in records] == [None, None]
    assert records[0].extra == {"answer": "a"}  # with no answer key, the field is just another extra


def test_missing_prompt_field_names_file_row_field_and_available(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"question": "q", "answer": "1"}])
    with pytest.raises(ValueError) as err:
        load_records(path)
    message = str(err.value)
    assert "bad.jsonl" in message and "row 1 (line 2)" in message and "'prompt'" in message
    assert "['answer', 'question']" in message


def test_wrong_prompt_type(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([ROWS[0], ROWS[0], {"prompt": 42}]))
    with pytest.raises(ValueError, match=r"bad\.json: row 2: field 'prompt'.*got int"):
        load_records(path)


def test_bad_chat_message(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"row 0 \(line 1\): field 'prompt': message 0"):
        load_records(path)


def test_wrong_answer_type(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "answer": ["1"]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 0 \(line 1\): field 'answer'.*got list"):
        load_records(path)


def test_invalid_json_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1 \(line 3\): invalid JSON"):
        load_records(path)


def test_unsupported_suffix_and_missing_file(tmp_path):
    (tmp_path / "p.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match="unsupported prompt file type '.csv'"):
        load_records(tmp_path / "p.csv")
    with pytest.raises(FileNotFoundError):
        load_records(tmp_path / "nope.jsonl")


RECORDS = [
    PromptRecord("what is one plus two", "3"),
    PromptRecord("what is one plus two plus three plus four plus five", "15"),
    PromptRecord([{"role": "user", "content": "what is six"}], "6"),
]


def test_plain_tokenization_filters_overlong():
    tokenizer = make_tokenizer()
    out = tokenize_prompts(RECORDS[:2], tokenizer, max_prompt_length=6)
    assert out.n_filtered == 1
    assert out.records == [RECORDS[0]]
    assert out.prompt_ids == [tokenizer("what is one plus two")["input_ids"]]


def test_overlong_error_names_row_length_and_limit():
    with pytest.raises(ValueError, match=r"row 1: prompt is 11 tokens.*max_prompt_length=6"):
        tokenize_prompts(RECORDS[:2], make_tokenizer(), max_prompt_length=6, overlong="error")
    with pytest.raises(ValueError, match="overlong='drop'"):
        tokenize_prompts(RECORDS, make_tokenizer(), max_prompt_length=6, overlong="drop")


def test_chat_template_auto_applied():
    tokenizer = make_tokenizer(CHAT_TEMPLATE)
    out = tokenize_prompts(RECORDS, tokenizer, max_prompt_length=100)
    tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in out.prompt_ids]
    # A string prompt became one user message; the generation prompt ends every prompt.
    assert tokens[0] == ["<user>", "what", "is", "one", "plus", "two", "<end>", "<assistant>"]
    assert tokens[2] == ["<user>", "what", "is", "six", "<end>", "<assistant>"]
    assert out.n_filtered == 0


def test_chat_template_can_be_turned_off():
    tokenizer = make_tokenizer(CHAT_TEMPLATE)
    out = tokenize_prompts(RECORDS[:1], tokenizer, max_prompt_length=100, apply_chat_template=False)
    assert tokenizer.convert_ids_to_tokens(out.prompt_ids[0]) == ["what", "is", "one", "plus", "two"]
    # Chat prompts cannot be encoded without a template.
    with pytest.raises(ValueError, match="row 0: the prompt is a list of chat messages"):
        tokenize_prompts(RECORDS[2:], tokenizer, max_prompt_length=100, apply_chat_template=False)


def test_forcing_template_without_one_is_an_error():
    with pytest.raises(ValueError, match="no chat_template"):
        tokenize_prompts(RECORDS, make_tokenizer(), max_prompt_length=100, apply_chat_template=True)
