"""`posttrain tune`: the pick is within 10% of a brute-force sweep's best; the overlay is a valid config."""

import shlex
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from posttrain.config.load import build_config
from posttrain.config.plan import build_plan
from posttrain.planning.autotune import Target, autotune, tune_targets
from posttrain.planning.measure import TrialSpec, run_trial_in_subprocess
from posttrain.planning.shape import builtin_tiny_hf_config

OVERRIDES = [
    "data.max_prompt_length=32",
    "data.max_response_length=16",
    "data.train_batch_size=16",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size_per_gpu=4",
]


@pytest.mark.slow
def test_tune_picks_within_10_percent_of_the_brute_force_best(tmp_path):
    cfg = build_config(overrides=OVERRIDES)
    mc = builtin_tiny_hf_config().to_dict()
    target = Target("actor", "actor.ppo_micro_batch_size_per_gpu", (1, 4, 16), False, rows=16)

    def throughput(value: int) -> float:
        spec = TrialSpec(
            role="actor",
            model_config=mc,
            prompt_len=32,
            response_len=16,
            rows=16,
            micro_batch_size=value,
            repeats=2,
        )
        res = run_trial_in_subprocess(spec)
        assert res.status == "ok", res.error
        return res.tokens_per_s

    sweep = {
        value: throughput(value) for value in target.candidates
    }  # one at a time: throughput needs the cores

    def tune():
        return autotune(
            cfg,
            [target],
            mc,
            [],
            memory_cap_bytes=8 * 2**30,
            time_budget_s=120,
            max_trials=3,
            progress=lambda _: None,
        )

    result = tune()
    pick = result.best[target.key].value
    best = max(sweep, key=sweep.get)
    if sweep[pick] < 0.9 * sweep[best]:
        # Two measurements of one setting differ by up to ~10% on a shared VM: measure both again, keep each
        # one's best (the peak is what the tuner compares), then judge the pick.
        for value in (pick, best):
            sweep[value] = max(sweep[value], throughput(value))
    if sweep[pick] < 0.9 * max(sweep.values()):
        # The tuner measures each setting once, so one disturbed trial can mislead it (seen once in CI: its
        # trial of 16 ran ~25% slow). An independent second tune must then pick well.
        result = tune()
        pick = result.best[target.key].value
    assert sweep[pick] >= 0.9 * max(sweep.values()), (pick, sweep)
    overlay = tmp_path / "tuned.yaml"
    overlay.write_text(yaml.safe_dump(result.overlay()))
    base = [o for o in OVERRIDES if not o.startswith("actor.ppo_micro")]  # command-line overrides beat YAML
    assert build_plan(build_config([overlay], base)).actor.micro_batch_size_per_rank == pick


def test_a_trial_over_the_cap_does_not_fit_and_stops_the_role():
    cfg = build_config(overrides=OVERRIDES)
    target = Target("actor", "actor.ppo_micro_batch_size_per_gpu", (1, 2, 4), False, rows=4)
    from posttrain.planning.measure import TrialResult

    def fake(spec):  # memory grows with the micro-batch; the cap admits 1 and 2
        return TrialResult(
            "ok", peak_bytes=spec.micro_batch_size * 100, seconds=1.0 / spec.micro_batch_size, tokens=256
        )

    result = autotune(
        cfg, [target], {}, [], memory_cap_bytes=250, headroom=0.0, runner=fake, progress=lambda _: None
    )
    assert [t.value for t in result.trials] == [1, 2, 4]
    assert [t.fits for t in result.trials] == [True, True, False]
    assert result.best[target.key].value == 2


def test_targets_are_valid_for_the_plan():
    gae = [
        "algorithm.adv_estimator=gae",
        "critic.ppo_mini_batch_size=8",
        "critic.ppo_micro_batch_size_per_gpu=4",
    ]
    cfg = build_config(overrides=[*OVERRIDES, *gae])
    plan = build_plan(cfg)
    targets = {t.key: t for t in tune_targets(cfg, plan)}
    assert set(targets) == {
        "actor.ppo_micro_batch_size_per_gpu",
        "actor.log_prob_micro_batch_size_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu",
        "critic.forward_micro_batch_size_per_gpu",
    }
    for v in targets["actor.ppo_micro_batch_size_per_gpu"].candidates:  # each divides the mini-batch per rank
        build_plan(build_config(overrides=[*OVERRIDES, f"actor.ppo_micro_batch_size_per_gpu={v}"]))


def test_tune_cli_with_no_time_budget_writes_an_estimated_overlay(tmp_path, capsys):
    out = tmp_path / "tuned.yaml"
    assert (
        main(["tune", *OVERRIDES, "--time-budget-s", "0", "--memory-cap-gb", "2", "--output", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert "starting point for a tiny" in text and "nothing measured" in text
    overlay = yaml.safe_load(Path(out).read_text())
    assert overlay["actor"]["ppo_micro_batch_size_per_gpu"] >= 1
    build_plan(build_config([out], OVERRIDES))
    assert main(["tune", "--headroom", "1.5", "--time-budget-s", "0"]) == 2


def test_tune_writes_into_the_run_directory_and_suggests_a_quoted_command(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "t"
    args = [*OVERRIDES, f"trainer.run_dir={run_dir}", "--time-budget-s", "0", "--memory-cap-gb", "2"]
    assert main(["tune", *args]) == 0
    assert (run_dir / "tuned.yaml").is_file() and not (tmp_path / "tuned.yaml").exists()
    use = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("use it: "))
    words = shlex.split(use.removeprefix("use it: "))
    assert words[:2] == ["posttrain", "train"] and str(run_dir / "tuned.yaml") in words
    build_plan(build_config([w for w in words[2:] if "=" not in w], [w for w in words[2:] if "=" in w]))
