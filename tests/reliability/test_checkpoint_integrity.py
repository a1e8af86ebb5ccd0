"""Checkpoint integrity: checksums recorded at save, verified on resume, eval and load; damaged checkpoints
are named by file, and resume=auto falls back to the newest intact one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from posttrain.cli import main
from posttrain.config.errors import CheckpointError
from posttrain.rl.train_command import run_training
from posttrain.train.checkpoint import (
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from tests.helpers import read_metrics, small_config, small_overrides


def _save_tiny(run_dir: Path, step: int) -> Path:
    torch.manual_seed(step)
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return save_checkpoint(
        run_dir,
        step,
        modules={"m": model},
        optimizers={"m": opt},
        schedulers={"m": sched},
        trainer_state={"step": step},
    )


def _load_tiny(path: Path) -> dict:
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return load_checkpoint(path, modules={"m": model}, optimizers={"m": opt}, schedulers={"m": sched})


def _largest_shard(ckpt: Path) -> Path:
    return max(
        (p for p in (ckpt / "state").iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )


def _overwrite_middle(path: Path, n: int = 4096) -> None:
    """Change n bytes in the middle of a file, keeping its size (what a size check cannot see)."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - n // 2)
    end = min(len(data), start + n)
    data[start:end] = bytes(255 - b for b in data[start:end])
    path.write_bytes(bytes(data))


def test_manifest_records_a_sha256_per_file(tmp_path):
    ckpt = _save_tiny(tmp_path, 1)
    manifest = read_manifest(ckpt)
    assert set(manifest["sha256"]) == set(manifest["files"])
    assert all(len(v) == 64 for v in manifest["sha256"].values())


@pytest.mark.parametrize(
    "name", ["trainer_state.json", "rng.pt", "state/.metadata", "shard", "manifest.json"]
)
def test_garbage_in_a_checkpoint_file_is_a_checkpoint_error_naming_it(tmp_path, name):
    ckpt = _save_tiny(tmp_path, 1)
    target = _largest_shard(ckpt) if name == "shard" else ckpt / name
    if name == "shard":
        _overwrite_middle(target)
    else:
        target.write_bytes(b"\x00garbage{" * 7)
    with pytest.raises(CheckpointError, match=target.name):
        _load_tiny(ckpt)
    with pytest.raises(CheckpointError, match=target.name):
        find_checkpoint(tmp_path, str(ckpt))


def test_garbage_latest_pointer_is_named(tmp_path):
    _save_tiny(tmp_path, 1)
    (tmp_path / "checkpoints" / "latest").write_text("\x00\x01 not a name")
    with pytest.raises(CheckpointError, match="latest"):
        find_checkpoint(tmp_path, "auto")


def test_auto_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    older = _save_tiny(tmp_path, 1)
    newest = _save_tiny(tmp_path, 2)
    shard = _largest_shard(newest)
    _overwrite_middle(shard)
    with pytest.warns(UserWarning, match=shard.name):
        assert find_checkpoint(tmp_path, "auto") == older
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001", "step_000002"]  # nothing deleted


@pytest.mark.parametrize("name", ["manifest.json", "COMPLETE"])
def test_a_deleted_manifest_or_marker_falls_back_with_a_warning_naming_the_checkpoint(tmp_path, name):
    """Drill: deleting either file made resume=auto fall back silently; it now says which checkpoint it passed
    over and what is missing."""
    older = _save_tiny(tmp_path, 1)
    newest = _save_tiny(tmp_path, 2)
    (newest / name).unlink()
    with pytest.warns(UserWarning, match=f"{newest.name}: {name} missing"):
        assert find_checkpoint(tmp_path, "auto") == older


def test_auto_refuses_when_every_checkpoint_is_damaged(tmp_path):
    ckpt = _save_tiny(tmp_path, 1)
    _overwrite_middle(_largest_shard(ckpt))
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="resume=disable"):
        find_checkpoint(tmp_path, "auto")


def test_a_save_that_does_not_verify_leaves_latest_and_older_checkpoints(tmp_path, monkeypatch):
    from posttrain.train import checkpoint as ckpt_mod

    older = _save_tiny(tmp_path, 1)
    real = ckpt_mod.verify_files

    def damaged(path, manifest):
        if path.name == "step_000002":
            raise CheckpointError(f"{path} is damaged (simulated)")
        return real(path, manifest)

    monkeypatch.setattr(ckpt_mod, "verify_files", damaged)
    with pytest.raises(CheckpointError, match="simulated"):
        save_checkpoint(tmp_path, 2, modules={"m": nn.Linear(64, 64)}, keep_last=1)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == older.name
    assert older.is_dir()


def test_resume_skips_a_damaged_newest_checkpoint_and_finishes(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    extra = ("trainer.save_freq=1", "trainer.max_ckpt_to_keep=3", "trainer.export_hf=false")
    run_training(small_config(tiny_model_dir, run, *extra), quiet=True)
    shard = _largest_shard(run / "checkpoints" / "step_000002")
    _overwrite_middle(shard)
    with pytest.warns(UserWarning, match=shard.name):
        run_training(small_config(tiny_model_dir, run, *extra, "trainer.total_steps=3"), quiet=True)
    assert (run / "checkpoints" / "step_000001").is_dir()  # the checkpoint it fell back to is kept
    assert read_metrics(run)[-1]["step"] == 3


def test_cli_names_a_garbage_trainer_state_without_traceback(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = small_overrides(tiny_model_dir, run, "trainer.total_steps=1", "trainer.export_hf=false")
    assert main(["train", *args]) == 0
    (run / "checkpoints" / "step_000001" / "trainer_state.json").write_text("{not json")
    capsys.readouterr()
    resume = f"trainer.resume={run / 'checkpoints' / 'step_000001'}"
    assert main(["train", *args, "trainer.total_steps=2", resume]) == 2
    err = capsys.readouterr().err
    assert "trainer_state.json" in err and "Traceback" not in err


def test_eval_names_a_truncated_model_file(tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["eval", "--model", str(model), f"model.path={tiny_model_dir}"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "truncated" in err and "Traceback" not in err


def test_eval_of_a_damaged_checkpoint_names_the_file(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = small_overrides(tiny_model_dir, run, "trainer.total_steps=1", "trainer.export_hf=false")
    assert main(["train", *args]) == 0
    ckpt = run / "checkpoints" / "step_000001"
    shard = _largest_shard(ckpt)
    _overwrite_middle(shard)
    capsys.readouterr()
    assert main(["eval", "--model", str(ckpt), *args]) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "sha256" in err and "Traceback" not in err


def test_eval_of_an_incomplete_checkpoint_says_which_are_complete(tiny_model_dir, tmp_path, capsys):
    """Drill: the message suggested a Python call, `find_checkpoint(run_dir, 'auto')`, to a CLI user."""
    run = tmp_path / "run"
    _save_tiny(run, 1)
    partial = run / "checkpoints" / "step_000002"
    partial.mkdir()
    assert main(["eval", "--model", str(partial), *small_overrides(tiny_model_dir, tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert f"{partial} is not a complete checkpoint" in err and "step_000001" in err
    assert "find_checkpoint" not in err and "Traceback" not in err
