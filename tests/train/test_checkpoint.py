"""Checkpoint round trips, resume modes, pruning and crash safety (CPU, tiny models)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from posttrain.train import checkpoint as ckpt
from posttrain.train.checkpoint import (
    find_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


class TiedLM(nn.Module):
    """Embedding and output head share one weight, like most causal LMs."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.embed(ids))))


def _train_state(seed: int = 0):
    """A model, AdamW and LambdaLR after one real step, so optimizer state is non-trivial."""
    torch.manual_seed(seed)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ids = torch.randint(0, 11, (3, 5))
    model(ids).logsumexp(-1).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return model, opt, sched


def _save(run_dir: Path, step: int, model: nn.Module, opt, sched, **kw) -> Path:
    return save_checkpoint(
        run_dir,
        step,
        modules={"policy": model},
        optimizers={"policy": opt},
        schedulers={"policy": sched},
        trainer_state={"step": step, "sampler": {"epoch": 1, "index": 7}, "kl_coef": 0.05},
        **kw,
    )


def _load(path: Path, **kw) -> tuple[dict, nn.Module, torch.optim.Optimizer]:
    model, opt, sched = _train_state(seed=123)  # different init: the load must overwrite it
    state = load_checkpoint(
        path, modules={"policy": model}, optimizers={"policy": opt}, schedulers={"policy": sched}, **kw
    )
    return state, model, opt


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tmp_path: Path) -> None:
    model, opt, sched = _train_state()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = _save(tmp_path, 12, model, opt, sched)
    expected_draws = (torch.rand(4), random.random(), np.random.rand(3))

    assert path == tmp_path / "checkpoints" / "step_000012"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000012"
    other, other_opt, other_sched = _train_state(seed=99)
    torch.rand(10), random.random(), np.random.rand(5)  # move every generator away from the saved state
    state = load_checkpoint(
        path, modules={"policy": other}, optimizers={"policy": other_opt}, schedulers={"policy": other_sched}
    )

    assert state == {"step": 12, "sampler": {"epoch": 1, "index": 7}, "kl_coef": 0.05}
    assert torch.equal(torch.rand(4), expected_draws[0])
    assert random.random() == expected_draws[1]
    np.testing.assert_array_equal(np.random.rand(3), expected_draws[2])
    for name, tensor in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor), name
    assert other.head.weight is other.embed.weight, "tying must survive the load"
    saved_opt, loaded_opt = opt.state_dict(), other_opt.state_dict()
    assert saved_opt["param_groups"] == loaded_opt["param_groups"]
    for pid, pstate in saved_opt["state"].items():
        for key, value in pstate.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded_opt["state"][pid][key]))
    assert other_sched.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"] == 1
    assert other_sched.get_last_lr() == sched.get_last_lr()


def test_state_is_keyed_by_parameter_name(tmp_path: Path) -> None:
    """Weights and optimizer moments are stored under parameter names with their global shapes, never
    parameter ids: what lets a checkpoint load at another world size or wrapping."""
    from posttrain.train.sharded_state import saved_shapes

    path = _save(tmp_path, 1, *_train_state())
    shapes = saved_shapes(path / "state")
    assert shapes["policy.model.embed.weight"] == (11, 6)
    assert shapes["policy.optim.state.proj.weight.exp_avg"] == (6, 6)
    assert not any(".state.0." in name for name in shapes)


def test_restore_rng_false_leaves_generators_alone(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    path = save_checkpoint(tmp_path, 1, modules={"m": model})
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    load_checkpoint(path, modules={"m": model}, restore_rng=False)
    assert torch.equal(torch.rand(3), expected)


def test_load_errors_name_the_module_key(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, *_train_state())
    wrong = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"modules\['policy'\].*missing.*unexpected"):
        load_checkpoint(
            path,
            modules={"policy": wrong},
            optimizers={"policy": _train_state()[1]},
            schedulers={"policy": _train_state()[2]},
        )
    model, opt, sched = _train_state()
    with pytest.raises(ValueError, match=r"modules\['critic'\].*no state"):
        load_checkpoint(path, modules={"policy": model, "critic": nn.Linear(2, 2)})
    with pytest.raises(ValueError, match=r"optimizers \['policy'\].*not passed"):
        load_checkpoint(path, modules={"policy": model})
    bigger = TiedLM(vocab=13)
    with pytest.raises(ValueError, match=r"modules\['policy'\].*shape mismatch.*embed.weight"):
        load_checkpoint(
            path, modules={"policy": bigger}, optimizers={"policy": opt}, schedulers={"policy": sched}
        )


def test_bad_arguments_raise_value_errors(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="step=-1"):
        save_checkpoint(tmp_path, -1, modules={"m": model})
    with pytest.raises(ValueError, match="keep_last=0"):
        save_checkpoint(tmp_path, 1, modules={"m": model}, keep_last=0)
    with pytest.raises(ValueError, match="key 'a/b'"):
        save_checkpoint(tmp_path, 1, modules={"a/b": model})
    with pytest.raises(ValueError, match="trainer_state is not JSON-serialisable"):
        save_checkpoint(tmp_path, 1, modules={"m": model}, trainer_state={"x": torch.ones(1)})
    assert not (tmp_path / "checkpoints").exists()  # arguments are checked before anything is written


def test_resume_modes(tmp_path: Path) -> None:
    assert find_checkpoint(tmp_path, "auto") is None
    model, opt, sched = _train_state()
    first = _save(tmp_path, 1, model, opt, sched)
    second = _save(tmp_path, 2, model, opt, sched)
    assert find_checkpoint(tmp_path, "auto") == second
    assert find_checkpoint(tmp_path, "disable") is None
    assert find_checkpoint(tmp_path, str(first)) == first
    assert find_checkpoint(tmp_path, "step_000001") == first  # relative to run_dir/checkpoints
    with pytest.raises(ValueError, match=r"resume='.*step_000099'.*does not exist.*step_000001.*step_000002"):
        find_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step_000099"))
    (first / "COMPLETE").unlink()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        find_checkpoint(tmp_path, str(first))
    with pytest.raises(ValueError, match="resume=''"):
        find_checkpoint(tmp_path, "")


def test_latest_pointer_wins_over_highest_step(tmp_path: Path) -> None:
    """A run resumed from step 1 after reaching step 5 continues from 1: `latest` follows the new saves."""
    model, opt, sched = _train_state()
    for step in (1, 5, 2):
        _save(tmp_path, step, model, opt, sched)
    assert latest_checkpoint(tmp_path).name == "step_000002"
    (tmp_path / "checkpoints" / "latest").unlink()  # without a pointer: highest complete step
    assert latest_checkpoint(tmp_path).name == "step_000005"


def test_keep_last_prunes_older_checkpoints(tmp_path: Path) -> None:
    model, opt, sched = _train_state()
    for step in range(1, 6):
        _save(tmp_path, step, model, opt, sched, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step_000004",
        "step_000005",
    ]
    _load(list_checkpoints(tmp_path)[-1])


def test_saving_the_same_step_twice_replaces_it(tmp_path: Path) -> None:
    model, opt, sched = _train_state()
    _save(tmp_path, 3, model, opt, sched)
    with torch.no_grad():
        model.proj.bias.fill_(7.0)
    path = _save(tmp_path, 3, model, opt, sched)
    _, loaded, _ = _load(path)
    assert torch.all(loaded.proj.bias == 7.0)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000003"]


@pytest.mark.parametrize("failing", ["_write_model_state", "_write_rng_state", "_write_manifest", "_publish"])
def test_exception_mid_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch, failing: str) -> None:
    model, opt, sched = _train_state()
    previous = _save(tmp_path, 1, model, opt, sched)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, failing, boom)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, model, opt, sched)

    assert find_checkpoint(tmp_path, "auto") == previous
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001"]
    state, _, _ = _load(previous)
    assert state["step"] == 1


def _arm_crash(crash_at: str) -> None:
    """In the child only: die with os._exit(1) at `crash_at` (an internal function of the checkpoint
    module), or for "after_move_aside" right after the old copy of a re-saved step was renamed away and
    before the new copy took its name."""
    if crash_at != "after_move_aside":
        setattr(ckpt, crash_at, lambda *args, **kwargs: os._exit(1))
        return
    real_replace = os.replace

    def replace_then_crash(src, dst):
        real_replace(src, dst)
        if ".replaced-" in str(dst):
            os._exit(1)

    os.replace = replace_then_crash


def _crash_in_child(run_dir: Path, step: int, crash_at: str) -> None:
    """Save `step` in a forked child that crashes hard: os._exit runs no except/finally/atexit code, so
    the disk is left exactly as a killed process would leave it. (Fork instead of a fresh interpreter:
    same crash, without paying the torch import per case.)"""
    pid = os.fork()
    if pid == 0:  # child: must never return into pytest
        try:
            _arm_crash(crash_at)
            torch.manual_seed(step + 100)
            save_checkpoint(run_dir, step, modules={"m": nn.Linear(3, 2)}, trainer_state={"step": -1})
        finally:
            os._exit(2)  # only reached when the crash point was never hit
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1, "the child did not crash where it was told to"


def _linear_state(path: Path) -> dict:
    model = nn.Linear(3, 2)
    state = load_checkpoint(path, modules={"m": model})
    return {"trainer": state, "weight": model.weight.detach().clone()}


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="crash tests fork a child process")


@needs_fork
@pytest.mark.parametrize("crash_at", ["_write_model_state", "_write_manifest", "_write_latest"])
def test_hard_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path, crash_at: str) -> None:
    torch.manual_seed(1)
    previous = save_checkpoint(tmp_path, 1, modules={"m": nn.Linear(3, 2)}, trainer_state={"step": 1})
    _crash_in_child(tmp_path, 2, crash_at)

    root = tmp_path / "checkpoints"
    stale = [p.name for p in root.iterdir() if p.name.startswith(".")]
    if crash_at != "_write_latest":
        assert len(stale) == 1 and stale[0].startswith(".tmp-step_000002-"), stale
        assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001"]
    else:  # step 2 was published but `latest` still names step 1: both are complete
        assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001", "step_000002"]
    assert (root / "latest").read_text().strip() == "step_000001"
    assert find_checkpoint(tmp_path, "auto") == previous
    assert _linear_state(previous)["trainer"] == {"step": 1}

    save_checkpoint(tmp_path, 3, modules={"m": nn.Linear(3, 2)}, trainer_state={"step": 3})
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "stale temp dirs are cleaned"
    assert find_checkpoint(tmp_path, "auto").name == "step_000003"


@needs_fork
def test_hard_crash_while_replacing_same_step_keeps_old_copy(tmp_path: Path) -> None:
    """Crash after the old step_000001 moved aside but before the new one landed."""
    torch.manual_seed(1)
    save_checkpoint(tmp_path, 1, modules={"m": nn.Linear(3, 2)}, trainer_state={"step": 1})
    expected = _linear_state(tmp_path / "checkpoints" / "step_000001")["weight"]

    _crash_in_child(tmp_path, 1, "after_move_aside")

    root = tmp_path / "checkpoints"
    assert not (root / "step_000001").exists()
    found = find_checkpoint(tmp_path, "auto")
    assert found is not None and found.name.startswith(".replaced-step_000001-")
    assert torch.equal(_linear_state(found)["weight"], expected)

    save_checkpoint(tmp_path, 2, modules={"m": nn.Linear(3, 2)}, trainer_state={"step": 2})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
    assert torch.equal(_linear_state(root / "step_000001")["weight"], expected)
    assert json.loads((root / "step_000001" / "trainer_state.json").read_text()) == {"step": 1}
