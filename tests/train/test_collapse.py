"""A collapsing run says so: one warning line per sign, fed the step metrics of recorded runs."""

from posttrain.config.load import build_config
from posttrain.train.collapse import CollapseWatch

# The 8 GRPO steps of a user's tool task that collapsed (success 3.8% -> 0%, tool-call rate 67% -> 97.5%, the
# model writing `The code is ": ": ...` until the budget from step 6, train reward 0).
COLLAPSING = [
    {"truncated/share": 0.22, "tools/call_frequency": 0.67, "reward/accuracy": 0.038, "reward/mean": 0.038,
     "actor/entropy": 0.61},
    {"truncated/share": 0.25, "tools/call_frequency": 0.72, "reward/accuracy": 0.031, "reward/mean": 0.031,
     "actor/entropy": 0.58},
    {"truncated/share": 0.31, "tools/call_frequency": 0.80, "reward/accuracy": 0.025, "reward/mean": 0.025,
     "actor/entropy": 0.52},
    {"truncated/share": 0.40, "tools/call_frequency": 0.88, "reward/accuracy": 0.012, "reward/mean": 0.012,
     "actor/entropy": 0.44},
    {"truncated/share": 0.47, "tools/call_frequency": 0.92, "reward/accuracy": 0.006, "reward/mean": 0.006,
     "actor/entropy": 0.30},
    {"truncated/share": 0.66, "tools/call_frequency": 0.95, "reward/accuracy": 0.0, "reward/mean": 0.0,
     "actor/entropy": 0.17},
    {"truncated/share": 0.81, "tools/call_frequency": 0.97, "reward/accuracy": 0.0, "reward/mean": 0.0,
     "actor/entropy": 0.09},
    {"truncated/share": 0.87, "tools/call_frequency": 0.975, "reward/accuracy": 0.0, "reward/mean": 0.0,
     "actor/entropy": 0.08},
]  # fmt: skip

# A healthy single-turn GRPO run: reward rising, entropy falling slowly, few truncations.
HEALTHY = [
    {"finish/length": 0.10 - 0.01 * s, "reward/mean": 0.3 + 0.05 * s, "reward/accuracy": 0.3 + 0.05 * s,
     "actor/entropy": 0.9 - 0.05 * s}
    for s in range(10)
]  # fmt: skip


def _watch(metrics_by_step):
    lines = []
    watch = CollapseWatch(warn=lines.append)
    fired = {step: watch.observe(step, m) for step, m in enumerate(metrics_by_step, start=1)}
    return lines, {step: out for step, out in fired.items() if out}


def test_the_collapsing_run_warns_once_per_sign_with_the_metric_and_the_advice():
    lines, fired = _watch(COLLAPSING)
    assert len(lines) == 4 and all("docs/reliability.md" in line for line in lines)
    assert all("\n" not in line for line in lines)  # one line each
    by_metric = {m: [s for s, out in fired.items() if any(m in line for line in out)] for m in (
        "truncated/share", "actor/entropy", "reward/mean was 0", "tools/call_frequency")}  # fmt: skip
    # truncation: 0.66 is 0.44 above the lowest (0.22); the tools fell behind from step 4 (0.88 vs 0.67 calls,
    # 1.2% vs 3.8% success); entropy under 0.2 x 0.61 at step 7; the third step of zero reward is step 8
    assert by_metric == {
        "truncated/share": [6], "actor/entropy": [7], "reward/mean was 0": [8], "tools/call_frequency": [4],
    }  # fmt: skip
    assert "lower actor.optim.lr" in lines[0] and "KL" in lines[0] and "warm-start" in lines[0]


def test_a_healthy_run_and_a_run_without_these_metrics_say_nothing():
    assert _watch(HEALTHY) == ([], {})
    sft_like = [{"sft/loss": 2.0 - 0.1 * s, "sft/grad_norm": 1.0} for s in range(10)]
    assert _watch(sft_like) == ([], {})


def _fired_at(overrides: list[str]) -> dict[str, int]:
    """The step at which each sign first fires on the collapsing run, with trainer.collapse.* ``overrides``."""
    watch = CollapseWatch(build_config(overrides=overrides).trainer.collapse, warn=lambda line: None)
    fired = {}
    for step, m in enumerate(COLLAPSING, start=1):
        for line in watch.observe(step, m):
            fired[line.split(": ", 2)[2].split(" ")[0]] = step
    return fired


def test_the_thresholds_are_the_trainer_collapse_knobs():
    assert _fired_at([]) == {
        "truncated/share": 6,
        "actor/entropy": 7,
        "reward/mean": 8,
        "tools/call_frequency": 4,
    }
    assert _fired_at(
        [
            "trainer.collapse.zero_reward_steps=2",  # the second step of zero reward is step 7
            "trainer.collapse.truncated_min=0.85",  # 0.87 at step 8
            "trainer.collapse.entropy_fraction=0.5",  # under 0.305 at step 5 (0.30)
            "trainer.collapse.tool_rate_rise=0.26",  # 0.95 at step 6 (0.28 above 0.67)
        ]
    ) == {"truncated/share": 8, "actor/entropy": 5, "reward/mean": 7, "tools/call_frequency": 6}
    lenient = ["trainer.collapse.zero_reward_steps=10", "trainer.collapse.truncated_jump=0.9"]
    assert set(_fired_at(lenient)) == {"actor/entropy", "tools/call_frequency"}
