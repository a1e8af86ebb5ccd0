"""Every command checks what the user named (reward, data files, model path, logger packages) before any
model loads: one message, exit code 2."""

import importlib.util
import json

import pytest

from posttrain import cli
from posttrain.rl import build, eval_command
from posttrain.sft import command as sft_command


@pytest.fixture
def no_model_loads(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the pre-flight checks failed")

    for module in (build, eval_command, sft_command):
        monkeypatch.setattr(module, "load_causal_lm", fail)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "Reverse: abc", "answer": "cba"}) + "\n")
    return path


@pytest.mark.parametrize("command", ["train", "eval", "sft", "explain"])
def test_a_bad_reward_fails_every_command_before_loading(command, data, tmp_path, no_model_loads, capsys):
    reward = tmp_path / "r.py"
    reward.write_text("def score(text):\n    return 0.0\n")
    args = [f"data.train_files=[{data}]", f"sft.train_files=[{data}]", "sft.response_key=answer"]
    code = cli.main([command, "model.path=builtin:base", f"reward.function={reward}:score", *args])
    assert code == 2
    assert "has signature (text), which fits none of the accepted styles" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "eval", "sft"])
def test_missing_data_file_and_model_path_fail_before_loading(
    command, data, tmp_path, no_model_loads, capsys
):
    missing = tmp_path / "nope.jsonl"
    assert cli.main([command, f"data.train_files=[{missing}]", "reward.function=exact_match"]) == 2
    assert f"data.train_files: file {str(missing)!r} not found" in capsys.readouterr().err
    args = [
        f"data.train_files=[{data}]",
        "reward.function=exact_match",
        f"model.path={tmp_path / 'no_model'}",
    ]
    assert cli.main([command, *args]) == 2
    assert "is not a Hugging Face model directory" in capsys.readouterr().err


def test_a_logger_without_its_package_names_the_install_command(monkeypatch, no_model_loads, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    assert cli.main(["train", "trainer.loggers=[console,jsonl,tensorboard]"]) == 2
    err = capsys.readouterr().err
    assert 'pip install "posttrain[tensorboard]"' in err and 'pip install -e ".[tensorboard]"' in err


def test_missing_sft_response_is_a_data_error_before_loading(tmp_path, no_model_loads, capsys):
    rows = tmp_path / "sft.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n" + json.dumps({"prompt": "q"}) + "\n")
    assert cli.main(["sft", "model.path=builtin:base", f"sft.train_files=[{rows}]"]) == 2
    assert "sft.jsonl: row 1 (line 2): missing field 'response'" in capsys.readouterr().err


def test_explain_checks_data_files_and_the_model_as_train_does(data, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert cli.main(["explain", f"data.train_files=[{missing}]", "reward.function=exact_match"]) == 2
    assert "not found" in capsys.readouterr().err
    args = [f"data.train_files=[{data}]", "reward.function=exact_match", f"model.path={tmp_path / 'later'}"]
    assert cli.main(["explain", *args]) == 2  # train would refuse it: explain does too
    assert "model.path=" in capsys.readouterr().err
