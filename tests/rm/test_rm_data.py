"""Preference data: formats, key names, margins, and errors that name file, row and key."""

import json

import pytest

from posttrain.config.errors import DataError
from posttrain.config.load import build_config
from posttrain.models.hf import load_tokenizer
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rm.data import encode, load_pairs, render, tokenize_pairs


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg_with(**rm):
    return build_config(overrides=[f"rm.{k}={v}" for k, v in rm.items()])


def test_strings_messages_and_implicit_prompt(tmp_path):
    rows = [
        {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"},
        {
            "prompt": [{"role": "user", "content": "Hi"}],
            "chosen": [{"role": "assistant", "content": "Hello!"}],
            "rejected": [{"role": "assistant", "content": "Go away."}],
        },
        {  # TRL's implicit prompt: whole conversations sharing their beginning
            "chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
            "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No."}],
        },
    ]
    pairs = load_pairs(cfg_with(), [str(write_jsonl(tmp_path / "p.jsonl", rows))])
    assert [p.prompt is None for p in pairs] == [False, False, True]
    assert pairs[0].chosen == "2" and pairs[1].chosen[0]["content"] == "Hello!"
    assert pairs[0].source.endswith("row 0") or "row 0" in pairs[0].source


def test_custom_keys_and_margin(tmp_path):
    rows = [{"q": "a", "good": "b", "bad": "c", "m": 0.5}, {"q": "a", "good": "d", "bad": "e", "m": 2}]
    cfg = cfg_with(prompt_key="q", chosen_key="good", rejected_key="bad", margin_key="m")
    pairs = load_pairs(cfg, [str(write_jsonl(tmp_path / "p.jsonl", rows))])
    assert [(p.prompt, p.chosen, p.rejected, p.margin) for p in pairs] == [
        ("a", "b", "c", 0.5),
        ("a", "d", "e", 2.0),
    ]


def test_parquet_and_saved_dataset(tmp_path):
    import datasets

    rows = [{"prompt": "p", "chosen": "yes", "rejected": "no"}] * 3
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for f in (tmp_path / "p.parquet", tmp_path / "saved"):
        pairs = load_pairs(cfg_with(), [str(f)])
        assert len(pairs) == 3 and pairs[0].rejected == "no"


@pytest.mark.parametrize(
    "row, needles",
    [
        ({"prompt": "p", "rejected": "r"}, ["row 1", "'chosen'", "rm.chosen_key"]),
        ({"prompt": "p", "chosen": "c"}, ["row 1", "'rejected'", "rm.rejected_key"]),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, ["row 1", "identical"]),
        ({"prompt": "p", "chosen": "  ", "rejected": "r"}, ["row 1", "'chosen'", "empty"]),
        ({"prompt": "p", "chosen": [], "rejected": "r"}, ["row 1", "'chosen'"]),
        ({"prompt": "p", "chosen": "c", "rejected": 3}, ["row 1", "'rejected'"]),
    ],
)
def test_bad_rows_name_file_row_and_key(tmp_path, row, needles):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}, row])
    with pytest.raises(DataError) as info:
        load_pairs(cfg_with(), [str(path)])
    message = str(info.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message


def test_margin_key_needs_a_number_in_every_row(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    with pytest.raises(DataError, match="rm.margin_key=margin"):
        load_pairs(cfg_with(margin_key="margin"), [str(path)])


def test_long_pairs_are_dropped_and_counted(tmp_path, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    rows = [
        {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"},
        {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3 " * 200},
    ]
    pairs = load_pairs(cfg_with(), [str(write_jsonl(tmp_path / "p.jsonl", rows))])
    kept, dropped = tokenize_pairs(pairs, tok, max_length=64)
    assert (len(kept), dropped) == (1, 1)


def test_rendering_matches_the_reward_model_scorer(tmp_path, tiny_model_dir):
    """The text trained on is the text `posttrain train` scores (same template, same special tokens)."""
    tok = load_tokenizer(tiny_model_dir)
    scorer = RewardModelScorer.__new__(RewardModelScorer)
    scorer.tokenizer, scorer.max_length = tok, None
    for prompt in ("What is 2 + 2?", [{"role": "user", "content": "What is 2 + 2?"}]):
        assert render(tok, prompt, "4") == scorer.format(prompt, "4")
    assert encode(tok, render(tok, "What is 2 + 2?", "4")) == scorer._encode(
        scorer.format("What is 2 + 2?", "4")
    )


def test_builtin_tiny_is_allowed_as_the_start_of_a_reward_model(tmp_path):
    """`posttrain train` refuses builtin:tiny beside the user's data files; for `posttrain rm` those files are
    pairs, and the demo's model is resolved from the task keys alone (the same cached directory as train's)."""
    from posttrain.config.errors import ConfigError
    from posttrain.config.load import build_config
    from posttrain.models.model_path import check_builtin_choice
    from posttrain.rm.command import model_config
    from posttrain.sft.builtin import warm_start_key

    cfg = build_config(
        overrides=["model.path=builtin:tiny", f"data.train_files=[{tmp_path / 'pairs.jsonl'}]"]
    )
    with pytest.raises(ConfigError, match="builtin:tiny"):
        check_builtin_choice(cfg)
    resolved = model_config(cfg)
    check_builtin_choice(resolved)
    assert warm_start_key(resolved) == warm_start_key(build_config(overrides=["model.path=builtin:tiny"]))
