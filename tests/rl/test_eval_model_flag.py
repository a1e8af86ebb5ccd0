"""`posttrain eval --model` takes what model.path takes (builtin:tiny, builtin:base, a Hub id, a model
directory) besides a checkpoint or an exported adapter over model.path."""

import pytest

from posttrain.cli import main
from posttrain.config.errors import MissingPathError
from posttrain.config.load import build_config
from posttrain.rl.eval_command import model_named_by_flag


def test_a_model_name_replaces_model_path_and_a_directory_is_read_over_it(tmp_path):
    cfg = build_config(overrides=[])
    for name in ("builtin:base", "builtin:tiny", "Qwen/Qwen2.5-0.5B-Instruct"):
        named, directory = model_named_by_flag(cfg, name)
        assert named.model.path == name and directory is None
    same, directory = model_named_by_flag(cfg, str(tmp_path))  # a checkpoint, an adapter or a model
    assert same is cfg and directory == str(tmp_path)
    assert model_named_by_flag(cfg, None) == (cfg, None)
    with pytest.raises(MissingPathError, match="--model no_such_dir is not a directory: .*builtin:base"):
        model_named_by_flag(cfg, "no_such_dir")


def test_eval_runs_on_builtin_base(tmp_path, capsys):
    args = [
        f"trainer.run_dir={tmp_path / 'run'}",
        "data.num_train_examples=16",
        "data.num_val_examples=4",
        "data.max_response_length=4",
    ]
    assert main(["eval", "--model", "builtin:base", *args]) == 0
    assert "builtin:base" in capsys.readouterr().out


def test_eval_refuses_builtin_tiny_on_user_data_as_model_path_does(tmp_path, capsys):
    rows = tmp_path / "val.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = [f"data.val_files=[{rows}]", f"data.train_files=[{rows}]", "reward.function=exact_match"]
    assert main(["eval", "--model", "builtin:tiny", *args]) == 2
    assert "builtin:tiny" in capsys.readouterr().err
