"""A run with an LLM judge (reward.judge.*): the config's checks before any model loads, and a short run that
trains on the rule plus the judge's score, served by a scripted judge over HTTP."""

import pytest

from posttrain.cli import main
from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, small_config
from tests.rewards.judge_server import ScriptedJudge, completion, fenced_response

RUBRIC = """\
criteria:
  - name: short
    template: "{prompt}\\n{response}\\nScore 0-10 for brevity. End with VERDICT: <0-10>."
"""


def judge_keys(tmp_path, url, *extra):
    rubric = tmp_path / "rubric.yaml"
    rubric.write_text(RUBRIC)
    return [
        "reward.judge.enable=true",
        f"reward.judge.base_url={url}",
        "reward.judge.model=judge",
        f"reward.judge.rubric={rubric}",
        *extra,
    ]


def test_a_missing_api_key_variable_stops_at_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_TEST_JUDGE_KEY", raising=False)
    keys = judge_keys(tmp_path, "http://127.0.0.1:9/v1", "reward.judge.api_key_env=POSTTRAIN_TEST_JUDGE_KEY")
    with pytest.raises(ConfigError, match="environment variable POSTTRAIN_TEST_JUDGE_KEY is not set"):
        build_config(overrides=keys)
    monkeypatch.setenv("POSTTRAIN_TEST_JUDGE_KEY", "sk-x")
    assert build_config(overrides=keys).reward.judge.api_key_env == "POSTTRAIN_TEST_JUDGE_KEY"


@pytest.mark.parametrize(
    "extra, match",
    [
        (["reward.judge.rubric="], "needs reward.judge.rubric"),
        (["reward.judge.base_url=localhost:8000"], "must be an http:// or https:// URL"),
        (["reward.rule_weight=0", "reward.judge.weight=0"], "all 0"),
        (["reward.judge.unparsed_score=2"], "reward.judge.unparsed_score"),
    ],
)
def test_bad_judge_keys(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=judge_keys(tmp_path, "http://127.0.0.1:9/v1", *extra))


def test_the_cli_exits_2_before_any_model_loads(tmp_path, capsys):
    """No model directory exists: the key's error comes first, as one message."""
    keys = judge_keys(tmp_path, "http://127.0.0.1:9/v1", "reward.judge.api_key_env=POSTTRAIN_TEST_UNSET_KEY")
    assert main(["train", f"model.path={tmp_path / 'no-model'}", *keys]) == 2
    err = capsys.readouterr().err
    assert "POSTTRAIN_TEST_UNSET_KEY is not set" in err and "Traceback" not in err


def brevity(request):
    return completion(f"VERDICT: {max(0, 10 - len(fenced_response(request).split()))}")


def test_a_run_trains_on_the_rule_plus_the_judge(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    with ScriptedJudge(brevity) as judge:
        keys = judge_keys(tmp_path, judge.base_url, "reward.rule_weight=0.5", "reward.judge.weight=2")
        run_training(small_config(tiny_model_dir, run, *keys), quiet=True)
        asked = len(judge.requests)
    steps = read_metrics(run)
    assert len(steps) == 2
    for step in steps:
        expected = 0.5 * step["reward/rule_mean"] + 2 * step["reward/judge/score_mean"]
        assert step["reward/mean"] == pytest.approx(expected, abs=1e-5)
        assert step["reward/judge/criterion/short"] == pytest.approx(step["reward/judge/score_mean"])
        assert step["reward/judge/unparsed"] == 0 and step["reward/judge/failures"] == 0
        assert (
            step["reward/judge/calls"] + step["reward/judge/cached"] == 16
        )  # 4 prompts x 4 samples x 1 criterion
        assert step["reward/judge/tokens"] == 7 * step["reward/judge/calls"]
        assert "timing/judge" in step and "reward/accuracy" not in step
    assert asked == sum(s["reward/judge/calls"] for s in steps)


def test_judging_during_generation_gives_the_same_steps(tiny_model_dir, tmp_path):
    """A judge behind an endpoint is asked about each sample as the engine finishes it (the default): the same
    verdicts, rewards, metrics and weights as asking after generation (reward.score_during_generation=never),
    every question asked ahead and none twice."""
    from safetensors.torch import load_file

    from tests.helpers import untimed

    runs = {}
    for when in ("never", "auto"):
        with ScriptedJudge(brevity, delay_s=0.02) as judge:
            keys = judge_keys(tmp_path, judge.base_url, f"reward.score_during_generation={when}")
            run_training(small_config(tiny_model_dir, tmp_path / when, *keys), quiet=True)
            runs[when] = (read_metrics(tmp_path / when), len(judge.requests))
    (after, asked_after), (during, asked_during) = runs["never"], runs["auto"]
    assert asked_during == asked_after
    for a, b in zip(after, during):
        assert a["reward/judge/ahead"] == 0 and b["reward/judge/ahead"] == b["reward/judge/calls"] > 0
        a, b = untimed(a), untimed(b)
        assert {k: v for k, v in a.items() if k != "reward/judge/ahead"} == {
            k: v for k, v in b.items() if k != "reward/judge/ahead"
        }
    weights = [load_file(tmp_path / w / "final_model" / "model.safetensors") for w in ("never", "auto")]
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])
