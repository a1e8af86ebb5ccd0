"""Seeing what the model does: train logs validation samples and the model directory it used; eval evaluates
data.val_files alone, prints a table and writes every sample; sft validates like train."""

import json

import yaml

from posttrain.config.load import build_config
from posttrain.rl.eval_command import run_eval_command
from posttrain.rl.train_command import run_training
from posttrain.sft.command import run_sft_command
from posttrain.utils.plots import plot_training_curves
from tests.helpers import read_metrics, sft_config, small_config


def test_train_writes_samples_run_info_and_plots_validation_reward(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_training(
        small_config(tiny_model_dir, run_dir, "trainer.test_freq=2", "trainer.loggers=[console,jsonl]")
    )
    out = capsys.readouterr().out
    assert "validation samples at step 0" in out and "validation samples at step 2" in out
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 2} and len(samples) == 16  # 8 validation prompts, twice
    assert set(samples[0]) == {"step", "prompt", "response", "ground_truth", "reward"}
    info = yaml.safe_load((run_dir / "run_info.yaml").read_text())
    assert info["resolved_model_path"] == str(tiny_model_dir.resolve())
    assert f"Model: {tiny_model_dir}" in out
    assert "val/reward_mean" in plot_training_curves(run_dir / "metrics.jsonl", tmp_path / "c.png")


def test_eval_of_val_files_alone_prints_a_table_and_writes_every_sample(tiny_model_dir, tmp_path, capsys):
    rows = [{"prompt": f"Reverse: ab{c}", "answer": f"{c}ba"} for c in "cgjkm"]
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = build_config(
        overrides=[
            f"data.val_files=[{val}]",
            "reward.function=exact_match",
            f"trainer.run_dir={tmp_path / 'ev'}",
            "data.max_response_length=4",
        ]
    )
    metrics = run_eval_command(cfg, model_path=str(tiny_model_dir))
    out = capsys.readouterr().out
    assert f"Evaluated {tiny_model_dir} on 5 problems (data.val_files={val})" in out
    assert "Reverse: abc" in out and "reward" in out  # the table
    written = [json.loads(line) for line in (tmp_path / "ev" / "eval_samples.jsonl").read_text().splitlines()]
    assert [w["prompt"] for w in written] == [r["prompt"] for r in rows]  # the files, not the built-in task
    assert metrics["val/accuracy"] == sum(w["reward"] >= 1 for w in written) / 5


def test_sft_validates_during_and_after_and_logs_like_train(tiny_model_dir, tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text(
        "\n".join(json.dumps({"prompt": f"What is {i} + 1?", "response": str(i + 1)}) for i in range(4))
    )
    extra = ("trainer.test_freq=2", "reward.function=exact_match", f"sft.val_files=[{val}]")
    cfg = sft_config(tiny_model_dir, tmp_path, *extra)
    run_sft_command(cfg, quiet=True)
    metrics = read_metrics(tmp_path / "run")
    val_steps = [m["step"] for m in metrics if "val/loss" in m]
    assert val_steps == [0, 2, 4, 6]  # before, every 2 steps, and the last (6 steps: 16 rows / 8, 3 epochs)
    assert all("val/accuracy" in m for m in metrics if "val/loss" in m)
    assert metrics[-1]["val/loss"] < metrics[0]["val/loss"]
    assert (tmp_path / "run" / "curves.png").exists()
    info = yaml.safe_load((tmp_path / "run" / "run_info.yaml").read_text())
    assert info["model_path"] == str(tiny_model_dir)
