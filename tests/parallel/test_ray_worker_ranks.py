"""Several trainer ranks fed by one rollout worker that Ray placed (`async_training.rollout_worker=ray` under
torchrun): rank 0 talks to the worker, which generates whole steps; every rank trains on its data share of
them. The run equals the one-process run with the same worker, and a failure on rank 0's side reaches the other
ranks as an error that names it.

Ray is an optional extra (``posttrain[ray]``, part of ``[dev]``): CI installs it, so there these tests must
run; elsewhere they skip when it is missing."""

from __future__ import annotations

import os

import pytest

from tests.parallel.conftest import torchrun
from tests.parallel.test_distributed_training import _metrics, _options, _run, _same_training

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]  # a hung job fails the test, its processes killed

if os.environ.get("CI") != "true":
    pytest.importorskip("ray")

RAY_AHEAD = {
    "async_training.enable": "true",
    "async_training.rollout_worker": "ray",
    "async_training.max_staleness": 1,
    "trainer.total_steps": 3,
}


def test_two_ranks_with_a_ray_worker_train_as_one(tmp_path, tiny_model_dir):
    """One step ahead, validation included (through rank 0's worker): the same samples, losses and policy
    lags on two ranks as on one."""
    runs = {}
    for nproc in (1, 2):
        run_dir = tmp_path / f"dp{nproc}"
        _run(nproc, tmp_path / f"o{nproc}", _options(tiny_model_dir, run_dir, **RAY_AHEAD))
        runs[nproc] = _metrics(run_dir)
    _same_training(runs[1], runs[2])
    steps = [m for m in runs[2] if m["step"] > 0]
    assert [m["async/policy_lag_max"] for m in steps] == [0.0, 1.0, 1.0]
    assert [m["async/policy_version"] for m in steps] == [0.0, 0.0, 1.0]
    assert "val/accuracy" in runs[2][0] and "val/accuracy" in runs[2][-1]


def test_a_failure_on_rank_0s_worker_reaches_every_rank_with_its_cause(tmp_path):
    out = tmp_path / "out"
    torchrun(2, "ahead_failure", out, {}, timeout=120)
    assert (out / "error_0.txt").read_text() == "ValueError: generate (1,) broke"
    other = (out / "error_1.txt").read_text()
    assert other.startswith("RolloutOnMainFailed: rank 1: the rollout worker failed on rank 0")
    assert "generate (1,) broke" in other


def test_each_rank_keeps_its_data_share_of_the_whole_step(tmp_path):
    out = tmp_path / "out"
    torchrun(2, "ahead_shares", out, {}, timeout=120)
    assert (out / "groups_0.txt").read_text() == "[0, 0, 1, 1] 0.5"
    assert (out / "groups_1.txt").read_text() == "[2, 2, 3, 3] 0.5"
