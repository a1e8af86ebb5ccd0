"""`posttrain rm` end to end on a tiny model: export loads with plain transformers and scores as in training,
`reward.model.path` accepts it unchanged, a killed run resumes to the same weights, bad data exits 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from posttrain.cli import main
from posttrain.config.load import build_config
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rm.command import run_rm_command
from posttrain.rm.data import render
from posttrain.rm.demo import write_arithmetic_pairs
from posttrain.utils.metrics import read_metrics
from tests.helpers import rm_cli_args

ROOT = Path(__file__).resolve().parents[2]


def rm_args(model_dir, data_dir, run_dir):
    return [
        f"model.path={model_dir}",
        f"data.train_files=[{data_dir / 'train.jsonl'}]",
        f"data.val_files=[{data_dir / 'val.jsonl'}]",
        f"trainer.run_dir={run_dir}",
        "rm.batch_size=4",
        "rm.micro_batch_size_per_gpu=2",
        "rm.max_steps=4",
        "rm.optim.lr=1e-3",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
    ]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    write_arithmetic_pairs(d, n_train=16, n_val=6, seed=3)
    return d


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, data_dir):
    run_dir = tmp_path_factory.mktemp("rm_run")
    cfg = build_config(overrides=rm_args(tiny_model_dir, data_dir, run_dir))
    return run_rm_command(cfg, quiet=True), run_dir


def test_export_loads_with_plain_transformers_and_scores_as_in_training(trained, data_dir):
    out, run_dir = trained
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.num_labels == 1
    rows = [json.loads(line) for line in (data_dir / "val.jsonl").read_text().splitlines()]
    texts = [render(tok, r["prompt"], r[k]) for k in ("chosen", "rejected") for r in rows]
    enc = tok(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        scores = model(**enc).logits[:, 0]
    last = read_metrics(run_dir / "metrics.jsonl")[-1]  # the final step's validation, measured in training
    assert float(scores.mean()) == pytest.approx(last["val/reward_mean"], abs=1e-5)
    assert float(scores.std(unbiased=False)) == pytest.approx(last["val/reward_std"], rel=1e-4, abs=1e-6)
    n = len(rows)
    assert float((scores[:n] > scores[n:]).float().mean()) == pytest.approx(last["val/accuracy"])
    assert model.config.reward_mean == pytest.approx(last["val/reward_mean"], abs=1e-6)
    assert model.config.reward_std == pytest.approx(last["val/reward_std"], abs=1e-6)

    # posttrain train's reward model (reward.model.path) takes the directory as it is and scores the same.
    scorer = RewardModelScorer(out, micro_batch_size=3)
    got = scorer.score([r["prompt"] for r in rows] * 2, [r[k] for k in ("chosen", "rejected") for r in rows])
    torch.testing.assert_close(torch.tensor(got), scores, atol=1e-5, rtol=1e-5)


def test_metrics_and_checkpoints_are_written(trained):
    _, run_dir = trained
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps[0] == 0 and steps[-1] == 4
    assert (run_dir / "checkpoints" / "latest").read_text().strip().endswith("4")
    assert (run_dir / "curves.png").exists()


def _cli(args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "posttrain", "rm", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.mark.long
def test_resume_after_a_kill_gives_the_same_final_weights(tmp_path, trained, tiny_model_dir, data_dir):
    full, _ = trained
    run_dir = tmp_path / "killed"
    args = rm_args(tiny_model_dir, data_dir, run_dir)
    crashed = _cli(args, env={"POSTTRAIN_TEST_CRASH": f"0:3:{tmp_path / 'crashed'}"})
    assert crashed.returncode == 1, crashed.stderr[-2000:]
    assert not (run_dir / "reward_model").exists()
    resumed = _cli(args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and "step 2" in resumed.stdout
    a = load_file(str(full / "model.safetensors"))
    b = load_file(str(run_dir / "reward_model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6)


def test_bad_pairs_exit_2_naming_file_row_and_key(tmp_path, tiny_model_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps({"prompt": "p"})
    )
    code = main(
        ["rm", f"model.path={tiny_model_dir}", f"data.train_files=[{bad}]", f"trainer.run_dir={tmp_path}"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "row 1" in err and "'chosen'" in err and "Traceback" not in err


def test_pairs_all_longer_than_max_length_say_to_raise_it(tmp_path, tiny_model_dir, capsys):
    """Drill: with every pair too long the message said "lower rm.batch_size", which cannot help."""
    assert main(["rm", *rm_cli_args(tmp_path / "run", tiny_model_dir, "rm.max_length=4")]) == 2
    err = capsys.readouterr().err
    assert "all 16 training pairs are longer than rm.max_length=4" in err and "raise rm.max_length" in err
    assert "rm.batch_size" not in err and "Traceback" not in err


def test_lora_reward_model_exports_merged_and_scores_as_in_training(tmp_path, tiny_model_dir, data_dir):
    """With LoRA the adapters and the new head train; the export is a plain merged classifier."""
    args = rm_args(tiny_model_dir, data_dir, tmp_path / "run")
    cfg = build_config(overrides=[*args, "model.lora_rank=4", "model.lora_alpha=8"])
    out = run_rm_command(cfg, quiet=True)
    assert not (out / "adapter_config.json").exists()
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    rows = [json.loads(line) for line in (data_dir / "val.jsonl").read_text().splitlines()]
    texts = [render(tok, r["prompt"], r[k]) for k in ("chosen", "rejected") for r in rows]
    with torch.no_grad():
        scores = model(**tok(texts, padding=True, add_special_tokens=False, return_tensors="pt")).logits[:, 0]
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert float(scores.mean()) == pytest.approx(last["val/reward_mean"], abs=1e-5)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    assert not torch.equal(
        base.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight
    )


def test_lora_resume_after_a_kill_gives_the_same_final_weights(tmp_path, tiny_model_dir, data_dir):
    """A LoRA run killed at step 3 resumes from its step-2 checkpoint (adapters, head, optimizer) and exports
    the same merged classifier as the run never interrupted."""
    lora = ["model.lora_rank=4", "model.lora_alpha=8"]
    full = run_rm_command(
        build_config(overrides=[*rm_args(tiny_model_dir, data_dir, tmp_path / "full"), *lora]), quiet=True
    )
    args = [*rm_args(tiny_model_dir, data_dir, tmp_path / "killed"), *lora]
    crashed = _cli(args, env={"POSTTRAIN_TEST_CRASH": f"0:3:{tmp_path / 'crashed'}"})
    assert crashed.returncode == 1, crashed.stderr[-2000:]
    resumed = _cli(args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and "step 2" in resumed.stdout
    a = load_file(str(full / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "reward_model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6)


def test_dynamic_batch_and_packing_train_the_same_weights(tmp_path, tiny_model_dir, data_dir):
    """rm.use_dynamic_bsz changes how a step's pairs are cut and model.use_remove_padding how they are laid out,
    not the run: the same losses and final weights as padded micro-batches of two pairs; a token budget a pair
    does not fit in is refused before training."""
    variants = {
        "count": [],
        "tokens": ["rm.use_dynamic_bsz=true", "rm.max_token_len_per_gpu=50"],  # one pair (42-46 tokens) each
        "packed": ["model.use_remove_padding=true", "model.remove_padding_max_row_tokens=64"],
    }
    rows, weights = {}, {}
    for name, extra in variants.items():
        run = tmp_path / name
        run_rm_command(build_config(overrides=rm_args(tiny_model_dir, data_dir, run) + extra), quiet=True)
        rows[name] = [r for r in read_metrics(run / "metrics.jsonl") if "rm/loss" in r]
        weights[name] = load_file(run / "reward_model" / "model.safetensors")
    assert {r["rm/micro_batches"] for r in rows["tokens"]} == {4}
    for name in ("tokens", "packed"):
        losses = [r["rm/loss"] for r in rows[name]]
        assert losses == pytest.approx([r["rm/loss"] for r in rows["count"]], rel=1e-4)
        for key, ref in weights["count"].items():  # Adam divides by sqrt(v): rounding can move a weight ~ lr
            torch.testing.assert_close(weights[name][key], ref, atol=5e-4, rtol=1e-4)
    tight = ["rm.use_dynamic_bsz=true", "rm.max_token_len_per_gpu=4"]
    assert main(["rm", *rm_args(tiny_model_dir, data_dir, tmp_path / "tight"), *tight]) == 2
