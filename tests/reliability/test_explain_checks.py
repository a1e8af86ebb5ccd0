"""explain runs the checks of the command it explains, so nothing explain accepts is refused later.

Drills (before: explain exited 0 and the command failed, often with a traceback): reward.model.path that
does not exist (train: `OSError: Repo id must be in the form...`), a causal LM as the reward model,
`explain rm` with trainer.resume=sometimes (rm refused only after writing run_info.yaml and loading the
model), a logger whose package is missing, and `eval --model` on a directory whose config.json is corrupt or
names an unknown model_type.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from posttrain.cli import main
from posttrain.rm.demo import write_arithmetic_pairs
from tests.helpers import small_overrides


def _error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith(f"posttrain {command}: error:")]
    return line.split("error: ", 1)[1]


def _train_and_explain(capsys, overrides: list[str]) -> str:
    assert main(["explain", *overrides]) == 2
    explained = _error(capsys, "explain")
    assert main(["train", *overrides]) == 2
    assert _error(capsys, "train") == explained
    return explained


def test_a_missing_reward_model_is_a_config_error_in_explain_and_train(tiny_model_dir, tmp_path, capsys):
    overrides = small_overrides(
        tiny_model_dir, tmp_path / "run", "reward.model.enable=true", "reward.model.path=/nonexistent"
    )
    message = _train_and_explain(capsys, overrides)
    assert "reward.model.path='/nonexistent'" in message and "not a directory" in message


def test_a_causal_lm_as_the_reward_model_is_refused_by_name(tiny_model_dir, tmp_path, capsys):
    overrides = small_overrides(
        tiny_model_dir, tmp_path / "run", "reward.model.enable=true", f"reward.model.path={tiny_model_dir}"
    )
    message = _train_and_explain(capsys, overrides)
    assert "ForCausalLM, not a sequence classifier" in message and "posttrain rm" in message


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_logger_without_its_package_is_refused_by_explain_and_train(tiny_model_dir, tmp_path, capsys):
    message = _train_and_explain(
        capsys, small_overrides(tiny_model_dir, tmp_path / "run", "trainer.loggers=[console,wandb]")
    )
    assert "wandb" in message and "pip install" in message


def _rm_args(tmp_path, *extra) -> list[str]:
    write_arithmetic_pairs(tmp_path / "pairs", n_train=16, n_val=4, seed=0)
    return [
        "model.path=builtin:base",
        f"data.train_files=[{tmp_path / 'pairs' / 'train.jsonl'}]",
        f"trainer.run_dir={tmp_path / 'run'}",
        "rm.batch_size=4",
        *extra,
    ]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["trainer.resume=sometimes"], "trainer.resume='sometimes'"),
        pytest.param(
            ["trainer.loggers=[console,wandb]"],
            "wandb",
            marks=pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb installed"),
        ),
        (["rm.margin_key=no_such_margin"], "rm.margin_key=no_such_margin"),
    ],
)
def test_explain_rm_refuses_what_rm_refuses_before_writing_anything(tmp_path, capsys, extra, words):
    args = _rm_args(tmp_path, *extra)
    assert main(["explain", "rm", *args]) == 2
    explained = _error(capsys, "explain")
    assert main(["rm", *args]) == 2
    assert _error(capsys, "rm") == explained and words in explained
    assert not (tmp_path / "run" / "run_info.yaml").exists()


@pytest.mark.parametrize(
    ("config", "words"),
    [('{"model_type": "qwen2", ', "not a valid JSON"), ('{"model_type": "no_such_arch"}', "no_such_arch")],
)
def test_eval_on_a_model_with_a_bad_config_is_one_line(tiny_model_dir, tmp_path, capsys, config, words):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text(config)
    overrides = small_overrides(tiny_model_dir, tmp_path / "run")
    assert main(["eval", "--model", str(model), *overrides]) == 2
    message = _error(capsys, "eval")
    assert f"--model='{model}'" in message and words in message


def test_a_model_path_with_a_bad_config_fails_explain_and_train(tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    message = _train_and_explain(capsys, small_overrides(model, tmp_path / "run"))
    assert "model.path=" in message and "no_such_arch" in message
