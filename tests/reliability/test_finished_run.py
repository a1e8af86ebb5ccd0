"""Drills on a finished run directory: the export is published whole (written beside final_model/, then renamed),
a rerun of a finished run whose export is missing or incomplete (a kill during the export) finishes the export,
and a refused rerun writes nothing; `posttrain rm` as `posttrain train`."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.rm import command as rm_command
from posttrain.utils.storage import model_dir_complete
from tests.helpers import rm_cli_args, small_overrides


def _snapshot(run: Path) -> dict[str, str]:
    """Every file of the run directory (the lock file aside) with its sha256."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *small_overrides(tiny_model_dir, run, "trainer.export_hf=true")]) == 0
    assert model_dir_complete(run / "final_model")
    return run


@pytest.fixture
def run_copy(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    return run


def test_a_refused_rerun_of_a_finished_run_writes_nothing(run_copy, tiny_model_dir, capsys):
    """Drill: the rerun used to rewrite config.yaml, plan.json and run_info.yaml with the new, never-run config
    before refusing."""
    before = _snapshot(run_copy)
    args = small_overrides(tiny_model_dir, run_copy, "trainer.export_hf=true", "actor.optim.lr=5e-3")
    assert main(["train", *args]) == 2
    assert "already holds a finished run" in capsys.readouterr().err
    assert _snapshot(run_copy) == before


@pytest.mark.parametrize("damage", ["only_config_json", "missing"])
def test_a_rerun_finishes_a_missing_or_incomplete_export(run_copy, tiny_model_dir, damage, capsys):
    """Drill: SIGKILL during the final export left final_model/ with only config.json, and the rerun refused
    ("already holds a finished run"); it now exports from the last checkpoint and exits 0."""
    final = run_copy / "final_model"
    if damage == "missing":
        shutil.rmtree(final)
    else:
        for p in final.iterdir():
            if p.name != "config.json":
                p.unlink()
    config_before = (run_copy / "config.yaml").read_bytes()
    assert main(["train", *small_overrides(tiny_model_dir, run_copy, "trainer.export_hf=true")]) == 0
    assert "without a complete final_model/" in capsys.readouterr().out
    assert model_dir_complete(final)
    assert (run_copy / "config.yaml").read_bytes() == config_before
    # a finished run with its export whole is refused again
    assert main(["train", *small_overrides(tiny_model_dir, run_copy, "trainer.export_hf=true")]) == 2


def test_an_export_killed_midway_leaves_no_final_model(tmp_path, tiny_model_dir):
    """The export is written under a hidden name and renamed into place: a writer that dies after config.json
    leaves no final_model/ (only a hidden partial directory, which the next export deletes)."""
    import os

    from posttrain.models.export import export_policy
    from posttrain.models.hf import load_causal_lm, load_tokenizer

    model = load_causal_lm(tiny_model_dir, "fp32", "cpu")
    tokenizer = load_tokenizer(tiny_model_dir)
    out = tmp_path / "final_model"

    class Killed(BaseException):
        pass

    def die(*args, **kwargs):  # as a SIGKILL between the config and the weights would
        raise Killed

    original = type(model).save_pretrained

    def config_then_die(self, path, *args, **kwargs):
        self.config.save_pretrained(path)
        die()

    type(model).save_pretrained = config_then_die
    try:
        with pytest.raises(Killed):
            export_policy(model, tokenizer, out)
    finally:
        type(model).save_pretrained = original
    assert not out.exists()
    partial = tmp_path / f".final_model.partial-{os.getpid()}"
    partial.mkdir()  # what a SIGKILL (no cleanup) leaves
    export_policy(model, tokenizer, out)
    assert model_dir_complete(out) and not partial.exists()


@pytest.fixture(scope="module")
def finished_rm_run(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("finished_rm") / "run"
    assert main(["rm", *rm_cli_args(run, tiny_model_dir)]) == 0
    return run


@pytest.fixture
def rm_copy(finished_rm_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_rm_run, run)
    return run


def test_an_rm_rerun_finishes_a_missing_or_incomplete_export(rm_copy, tiny_model_dir, capsys):
    """Drill: `posttrain rm` killed during its export (or stopped there by a full disk) left
    `.reward_model.partial-*` and every rerun said "already holds a finished reward-model run"."""
    out = rm_copy / "reward_model"
    weights = (out / "model.safetensors").read_bytes()
    for p in out.iterdir():
        if p.name != "config.json":
            p.unlink()
    (rm_copy / ".reward_model.partial-99999").mkdir()  # what a killed writer leaves
    info = (rm_copy / "run_info.yaml").read_bytes()
    capsys.readouterr()
    assert main(["rm", *rm_cli_args(rm_copy, tiny_model_dir)]) == 0
    assert "holds a finished reward-model run (step 4) without a complete" in capsys.readouterr().out
    assert model_dir_complete(out) and (out / "model.safetensors").read_bytes() == weights
    assert not list(rm_copy.glob(".reward_model.partial-*"))
    assert (rm_copy / "run_info.yaml").read_bytes() == info


def test_a_refused_rm_rerun_writes_nothing_and_loads_no_model(rm_copy, tiny_model_dir, monkeypatch, capsys):
    """Drill: the refused rerun rewrote run_info.yaml and had loaded the checkpoint into the new model first."""

    def no_model(*args, **kwargs):
        raise AssertionError("a refused rerun loaded a model")

    monkeypatch.setattr(rm_command, "load_reward_model", no_model)
    before = _snapshot(rm_copy)
    assert main(["rm", *rm_cli_args(rm_copy, tiny_model_dir, "rm.optim.lr=5e-3")]) == 2
    err = capsys.readouterr().err
    assert "already holds a finished reward-model run (checkpoint at step 4" in err and "Traceback" not in err
    assert _snapshot(rm_copy) == before
