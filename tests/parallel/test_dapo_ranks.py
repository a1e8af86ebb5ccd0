"""Dynamic sampling and overlong shaping on two data-parallel ranks train exactly as on one: each rank generates
its share of every generation batch, the scored shares are gathered, and every rank filters the same groups."""

from __future__ import annotations

import pytest

from tests.parallel.test_distributed_training import _metrics, _options, _run, _same_training

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]  # a hung job fails the test, its processes killed

REWARD = """
def half(prompt, response, ground_truth, extra):
    return 1.0 if int(ground_truth) % 2 == 0 else float(len(response) % 2)
"""


def test_two_ranks_filter_the_same_groups_as_one(tmp_path, tiny_model_dir):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    dapo = {
        "reward.function": f"{reward}:half",
        "reward.timeout_s": 0,
        "algorithm.filter_groups.enable": "true",
        "algorithm.filter_groups.metric": "seq_reward",
        "reward.overlong_buffer.enable": "true",
        "reward.overlong_buffer.len": 2,
        "reward.overlong_buffer.penalty_factor": 0.5,
        "reward.overlong_buffer.log": "true",
        "data.num_train_examples": 64,
    }
    runs = {}
    for nproc in (1, 2):
        run_dir = tmp_path / f"dp{nproc}"
        _run(nproc, tmp_path / f"o{nproc}", _options(tiny_model_dir, run_dir, **dapo))
        runs[nproc] = _metrics(run_dir)
    _same_training(runs[1], runs[2])
    for one, two in zip(runs[1], runs[2]):
        if "train/num_gen_batches" in one:  # training steps (not the initial validation)
            assert one["train/num_gen_batches"] >= 2
            for key in ("train/num_gen_batches", "filter_groups/num_dropped", "reward/overlong_penalty_mean"):
                assert two[key] == one[key], (one["step"], key)
