"""No waste on-policy: when a rollout feeds exactly one optimizer step, the update's own forward gives the old
log-probs and the old-log-prob pass is skipped; losses and gradients are those of the recomputed path."""

import dataclasses

import pytest

from posttrain.config.plan import build_plan
from posttrain.parallel.runtime import DistContext
from posttrain.rl import step
from posttrain.rl.build import build_components
from posttrain.utils.metrics import PhaseTimer
from tests.helpers import GradCapture, assert_grads_equal, small_config

ONE_STEP = ("actor.ppo_mini_batch_size=4", "actor.ppo_epochs=1")  # small_config: data.train_batch_size=4


@pytest.mark.parametrize(
    ("extra", "source"),
    [
        (ONE_STEP, "update"),
        ((), "recompute"),  # two mini-batches: the second is trained by an updated policy
        (("actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2"), "recompute"),
        ((*ONE_STEP, "algorithm.use_kl_in_reward=true"), "recompute"),  # the KL penalty needs them first
        ((*ONE_STEP, "algorithm.rollout_correction.rollout_is=token"), "recompute"),
        ((*ONE_STEP, "algorithm.rollout_correction.bypass_mode=true"), "rollout"),
        (("algorithm.rollout_correction.bypass_mode=true",), "rollout"),
    ],
)
def test_the_plan_says_where_old_log_probs_come_from(tiny_model_dir, tmp_path, extra, source):
    cfg = small_config(tiny_model_dir, tmp_path / "run", *extra)
    plan = build_plan(cfg)
    assert plan.old_log_prob_source == source
    assert plan.to_dict()["old_log_prob_source"] == source


def _one_step(cfg, source: str | None):
    """Gradient and metrics of step 1; ``source`` overrides the plan's old-log-prob source."""
    run = build_components(cfg, quiet=True, dist=DistContext())
    if source is not None:
        run.plan = dataclasses.replace(run.plan, old_log_prob_source=source)
    capture = GradCapture(p for p in run.actor.module.parameters() if p.requires_grad)
    capture.param_groups[0]["lr"] = 0.0  # read by the metrics
    run.actor.optimizer = capture
    metrics = step.train_step(run, 1, PhaseTimer())
    run.close()
    return capture.grads, metrics


@pytest.mark.parametrize("extra", [(), ("actor.use_kl_loss=true", "actor.entropy_coeff=0.01")])
def test_skipping_the_pass_gives_the_recomputed_losses_and_gradients(tiny_model_dir, tmp_path, extra):
    overrides = (
        *ONE_STEP,
        "actor.ppo_micro_batch_size_per_gpu=4",
        "actor.log_prob_micro_batch_size_per_gpu=4",
    )
    cfg = small_config(tiny_model_dir, tmp_path / "run", *overrides, "actor.shuffle=false", *extra)
    assert build_plan(cfg).old_log_prob_source == "update"
    grads, skipped = _one_step(cfg, None)
    ref_grads, recomputed = _one_step(cfg, "recompute")
    assert "timing/old_log_prob" in recomputed and "timing/old_log_prob" not in skipped
    assert skipped["reward/mean"] == recomputed["reward/mean"]  # the same samples
    assert_grads_equal(grads, ref_grads, "actor, old-log-prob pass skipped vs recomputed")
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        if key in recomputed:
            assert skipped[key] == pytest.approx(recomputed[key], rel=1e-5, abs=1e-6), key
    assert skipped["actor/pg_clipfrac"] == 0.0 and skipped["actor/ppo_kl"] == 0.0  # the ratio is exactly 1
    # The engine's log-probs are still compared with the trainer's: token-level diagnostics from the update.
    for key in ("kl", "k3_kl", "log_prob_abs_diff_mean", "chi2_token"):
        name = f"rollout_corr/{key}"
        assert skipped[name] == pytest.approx(recomputed[name], rel=1e-4, abs=1e-6), name
