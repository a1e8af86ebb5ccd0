"""Two RL steps on the tiny model with each of opo, gpg (with its gpg policy loss) and grpo_passk: the trainer
runs them end to end, and the advantages it computes have each estimator's defining property."""

import pytest
import torch

from posttrain.rl import step as rl_step
from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, small_config

RUNS = {
    "opo": [],
    "gpg": ["actor.policy_loss=gpg"],
    "grpo_passk": [],
}


def capture_advantages(monkeypatch):
    seen = []
    original = rl_step.compute_advantages

    def wrapper(batch, *args, **kwargs):
        metrics = original(batch, *args, **kwargs)
        seen.append(
            {
                "adv": batch.advantages.detach().clone(),
                "mask": batch.response_mask.detach().clone().bool(),
                "scores": batch.token_level_rewards.detach().sum(-1),
                "groups": batch.group_ids.detach().clone(),
            }
        )
        return metrics

    monkeypatch.setattr(rl_step, "compute_advantages", wrapper)
    return seen


def row_scalars(adv, mask):
    assert torch.all(adv[~mask] == 0), "advantage on padding"
    out = torch.zeros(adv.shape[0], dtype=adv.dtype)
    for i in range(adv.shape[0]):
        valid = adv[i][mask[i]]
        if valid.numel():
            assert torch.all(valid == valid[0]), "advantage not constant over the response"
            out[i] = valid[0]
    return out


def check_property(name, scalars, scores, lengths, groups):
    for g in groups.unique():
        members = groups == g
        a, r, n = scalars[members], scores[members], lengths[members]
        assert members.sum() == 4  # rollout.n
        if name == "opo":  # the length-weighted baseline: sum of l_i * A_i over a group is 0
            assert float((n * a).sum()) == pytest.approx(0.0, abs=1e-5)
        elif name == "gpg":  # group-centred (then scaled): the advantages of a group sum to 0
            assert float(a.sum()) == pytest.approx(0.0, abs=1e-5)
        else:  # pass@k: at most one sample per group is credited, and it has the top score
            credited = torch.nonzero(a).flatten()
            assert len(credited) <= 1
            if len(credited):
                assert r[credited[0]] == r.max() and a[credited[0]] > 0


@pytest.mark.parametrize("name", sorted(RUNS))
def test_two_steps_with_each_outcome_estimator(tiny_model_dir, tmp_path, monkeypatch, name):
    seen = capture_advantages(monkeypatch)
    cfg = small_config(tiny_model_dir, tmp_path / "run", f"algorithm.adv_estimator={name}", *RUNS[name])
    run_training(cfg, quiet=True)
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2] and len(seen) == 2
    for row in metrics:
        assert all(v == v for v in row.values()), row  # no NaN
    assert any(b["adv"].abs().max() > 0 for b in seen), "no learning signal: the checks would be vacuous"
    for step, batch in zip(metrics, seen):
        scalars = row_scalars(batch["adv"], batch["mask"])
        lengths = batch["mask"].sum(-1).to(scalars.dtype)
        check_property(name, scalars, batch["scores"].to(scalars.dtype), lengths, batch["groups"])
        if scalars.abs().max() > 0:  # a learning signal reaches the actor
            assert step["actor/grad_norm"] > 0
    if name == "gpg":
        assert "actor/ppo_kl" in metrics[-1] and "actor/pg_clipfrac" not in metrics[-1]
