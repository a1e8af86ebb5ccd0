"""The one training loop on a toy step: when it validates, logs and saves, what a resume restores, and that it
stops at trainer.max_skipped_steps."""

import pytest
import torch
from torch import nn

from posttrain.train.checkpoint import list_checkpoints
from posttrain.train.guards import NonFiniteError
from posttrain.train.loop import Checkpoints, LoopSettings, TrainLoop
from posttrain.utils.console import TrainingDisplay
from posttrain.utils.metrics import MetricsLogger, read_metrics


def _toy(run_dir, total=5, test_freq=2, save_freq=2, skipped=()):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    calls = {"validate": [], "state": []}

    def step(s):
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        return {"toy/loss": float(loss.detach()), **({"toy/skipped_steps": 1.0} if s in skipped else {})}

    def validate(s):
        calls["validate"].append(s)
        return {"val/w": float(model.weight.detach().sum())}

    def loop_state(s):
        calls["state"].append(s)
        return {"seen": s * 10}

    checkpoints = Checkpoints(
        run_dir=run_dir,
        modules={"toy": model},
        optimizers={"toy": optim},
        schedulers={"toy": sched},
        keep_last=5,
        loop_state=loop_state,
    )
    loop = TrainLoop(
        settings=LoopSettings(
            total_steps=total,
            test_freq=test_freq,
            save_freq=save_freq,
            max_skipped_steps=2,
            save_on_terminate=False,
        ),
        step=step,
        roles=("toy",),
        display=TrainingDisplay(total_steps=total, disable=True),
        logger=MetricsLogger(run_dir),
        validate=validate,
        checkpoints=checkpoints,
    )
    return loop, checkpoints, model, calls


def test_validation_logging_and_save_cadence(tmp_path):
    loop, _, _, calls = _toy(tmp_path)
    result = loop.run(0)
    assert calls["validate"] == [0, 2, 4, 5]  # before training, every test_freq, at the end
    assert calls["state"] == [2, 4, 5]  # every save_freq and at the end
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004", "step_000005"]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5] and "val/w" in rows[2] and "val/w" not in rows[3]
    assert result.first_validation.keys() == {"val/w"} and result.last["val/w"] == rows[-1]["val/w"]


def test_resume_restores_weights_and_loop_state_and_continues(tmp_path):
    full, _, full_model, _ = _toy(tmp_path / "full")
    full.run(0)
    first, _, _, _ = _toy(tmp_path / "cut", total=4)
    first.run(0)  # a run that stopped after step 4's checkpoint
    again, checkpoints, model, calls = _toy(tmp_path / "cut")
    start, state = checkpoints.resume("auto", announce=False)
    assert (start, state["seen"]) == (4, 40)
    again.run(start)
    assert calls["validate"] == [5]  # a resumed run does not validate before its first step
    assert torch.equal(model.weight, full_model.weight) and torch.equal(model.bias, full_model.bias)


def test_without_checkpoints_nothing_is_saved(tmp_path):
    loop, _, _, _ = _toy(tmp_path)
    loop.checkpoints = None
    loop.run(0)
    assert not (tmp_path / "checkpoints").exists()


def test_stops_at_the_limit_th_consecutive_skipped_step(tmp_path):
    loop, _, _, _ = _toy(tmp_path, skipped=(1, 3, 4))
    with pytest.raises(NonFiniteError, match=r"steps 3-4: .*toy.optim.lr"):
        loop.run(0)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")][-1] == 4


def test_the_loop_warns_once_when_the_steps_metrics_show_a_collapse(tmp_path, caplog):
    loop, _, _, _ = _toy(tmp_path, total=5, test_freq=0)
    toy_step = loop.step
    loop.step = lambda s: {**toy_step(s), "reward/mean": 0.0}  # no reward at any step: fires at step 3
    with caplog.at_level("WARNING", logger="posttrain"):
        loop.run(0)
    warnings = [r.getMessage() for r in caplog.records if "collapsing" in r.getMessage()]
    assert warnings == [
        "step 3: the run may be collapsing: reward/mean was 0 for 3 steps in a row; see docs/reliability.md, "
        "'A collapsing run' (lower actor.optim.lr, raise the KL coefficient, or warm-start with more SFT steps)"
    ]
