"""Drill: `posttrain explain` accepted configs that `posttrain train` then rejected (or that the docs call
invalid). One table of bad configs goes through both commands: each exits 2 with the same one-line message,
because both run the same checks (posttrain.planning.preflight.preflight)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from posttrain.cli import main
from tests.helpers import small_overrides

NO_GPU = not torch.cuda.is_available()
NO_VLLM = importlib.util.find_spec("vllm") is None
ASYNC = "async_training.enable=true"

# (id, overrides, words the message must hold)
BAD = [
    ("partial_without_async", ["async_training.partial_rollout=true"], "async_training.enable=false"),
    (
        "partial_with_filter_groups",
        [ASYNC, "async_training.partial_rollout=true", "algorithm.filter_groups.enable=true"],
        "filter_groups",
    ),
    (
        "rollout_rs_without_threshold",
        ["algorithm.rollout_correction.rollout_rs=token"],
        "rollout_rs_threshold",
    ),
    (
        "lora_targets_match_nothing",
        ["model.lora_rank=4", "model.target_modules=[nothing_proj]"],
        "nothing_proj",
    ),
    ("model_path_missing", ["model.path=no/such/dir/model"], "model.path"),
    ("resume_sometimes", ["trainer.resume=sometimes"], "sometimes"),
    pytest.param(
        "cuda_without_gpu",
        ["trainer.device=cuda"],
        "cuda",
        marks=pytest.mark.skipif(not NO_GPU, reason="a GPU is here"),
    ),
    pytest.param(
        "vllm_not_installed",
        ["rollout.name=vllm"],
        "vllm",
        marks=pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed"),
    ),
    (
        "too_few_train_examples",
        ["data.num_train_examples=5", "data.train_batch_size=8"],
        "num_train_examples",
    ),
    ("lora_alpha_zero", ["model.lora_rank=4", "model.lora_alpha=0"], "lora_alpha"),
    ("ray_worker_without_async", ["async_training.rollout_worker=ray"], "async_training.enable"),
]
BAD = [  # an id for each case; skipped ones keep their marks
    pytest.param(*b.values[1:], id=b.values[0], marks=b.marks)
    if hasattr(b, "values")
    else pytest.param(*b[1:], id=b[0])
    for b in BAD
]


def _error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith(f"posttrain {command}: error:")]
    assert "Traceback" not in err
    return line.split("error: ", 1)[1]


def _both(capsys, overrides: list[str]) -> tuple[str, str]:
    assert main(["explain", *overrides]) == 2, capsys.readouterr()
    explained = _error(capsys, "explain")
    assert main(["train", *overrides]) == 2, capsys.readouterr()
    return explained, _error(capsys, "train")


@pytest.mark.parametrize(("extra", "words"), BAD)
def test_explain_and_train_reject_the_same_configs_with_the_same_message(
    extra, words, tiny_model_dir, tmp_path, capsys
):
    overrides = small_overrides(tiny_model_dir, tmp_path / "run", "trainer.total_steps=1", *extra)
    explained, trained = _both(capsys, overrides)
    assert explained == trained
    assert words in trained
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("key", ["data.prompt_key", "data.answer_key"])
def test_a_data_key_missing_from_the_data_fails_explain_and_train(key, tiny_model_dir, tmp_path, capsys):
    """explain reads the first rows of each data file and checks every key it will use."""
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(64)))
    overrides = small_overrides(
        tiny_model_dir,
        tmp_path / "run",
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        f"{key}=no_such_field",
    )
    explained, trained = _both(capsys, overrides)
    assert explained == trained and "no_such_field" in trained


def test_a_data_directory_that_is_not_a_saved_dataset_is_a_config_error(tiny_model_dir, tmp_path, capsys):
    """Drill: a data.train_files entry that is a directory but not a save_to_disk dataset was a
    FileNotFoundError traceback."""
    pytest.importorskip("datasets")
    folder = tmp_path / "not_a_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    overrides = small_overrides(tiny_model_dir, tmp_path / "run", f"data.train_files=[{folder}]")
    explained, trained = _both(capsys, overrides)
    assert explained == trained and "not a dataset saved" in trained and str(folder) in trained
