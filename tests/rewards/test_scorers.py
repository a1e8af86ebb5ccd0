"""The built-in scorers picked by data_source, each on a table of known answers, and the dispatch itself."""

import pytest

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.data.scorers import gsm8k_flexible, gsm8k_strict, math_verify_score, scorer_for
from posttrain.data.splits import load_splits
from posttrain.rewards.functions import resolve_reward_function

pa = pytest.importorskip("pyarrow")  # the data extra; the vLLM environment has none
pq = pytest.importorskip("pyarrow.parquet")

GSM8K = [
    # response, ground truth, strict, flexible
    ("She pays 3 * 4 = 12 dollars.\n#### 12", "12", 1.0, 1.0),
    ("#### 1,200", "1200", 1.0, 1.0),
    ("#### $18.00", "18", 1.0, 1.0),
    ("#### -7", "-7", 1.0, 1.0),
    ("The answer is 12", "12", 0.0, 1.0),  # no '#### ': strict fails, flexible finds it
    ("#### 12 then I changed my mind to 13", "12", 1.0, 0.0),
    ("#### 13", "12", 0.0, 0.0),
    ("no number at all", "12", 0.0, 0.0),
]


@pytest.mark.parametrize("response, truth, strict, flexible", GSM8K)
def test_gsm8k_strict_and_flexible(response, truth, strict, flexible):
    assert gsm8k_strict("", response, truth, {}) == strict
    assert gsm8k_flexible("", response, truth, {}) == flexible


MATH = [
    # response, ground truth (as MATH/DAPO files hold it), score
    ("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),  # fraction vs decimal
    ("\\boxed{\\frac34}", "\\dfrac{3}{4}", 1.0),  # \dfrac, braces left out
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),  # simplified radicals
    ("\\boxed{5}", "5\\text{ cm}", 1.0),  # units dropped
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # symbolic equality
    ("Answer: 34", "34", 1.0),  # DAPO's answer line
    ("\\boxed{11}", "10", 0.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("I do not know", "10", 0.0),
]


@pytest.mark.parametrize("response, truth, score", MATH)
def test_math_verify_known_answers(response, truth, score):
    pytest.importorskip("math_verify")
    assert math_verify_score("", response, truth, {}) == score


def test_sources_dispatch_to_their_scorer():
    assert scorer_for("openai/gsm8k") is gsm8k_strict
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "math_dapo", "aime2024"):
        assert scorer_for(source) is math_verify_score
    assert scorer_for("my/own") is None
    fn = resolve_reward_function("data_source")
    assert fn("", "#### 5", "5", {"data_source": "openai/gsm8k"}) == 1.0
    with pytest.raises(ConfigError, match=r"data_source \['my/own'\].*openai/gsm8k.*reward.function="):
        fn("", "5", "5", {"data_source": "my/own"})


def _write(path, source):
    rows = [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "5"},
            "extra_info": {"split": "train", "index": 0},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_no_reward_function_picks_scorers_by_data_source(tmp_path):
    path = _write(tmp_path / "train.parquet", "openai/gsm8k")
    splits = load_splits(build_config(overrides=[f"data.train_files=[{path}]", "reward.function="]))
    assert splits.reward_spec == "data_source"


def test_unknown_data_source_is_an_error_listing_the_known_ones(tmp_path):
    path = _write(tmp_path / "train.parquet", "my/own")
    cfg = build_config(overrides=[f"data.train_files=[{path}]", "reward.function="])
    with pytest.raises(ConfigError, match=r"'my/own'.*known: .*lighteval/MATH.*compute_score"):
        load_splits(cfg)


def test_preflight_accepts_data_source_dispatch(tmp_path):
    from posttrain.planning.input_checks import _check_reward

    good = _write(tmp_path / "good.parquet", "openai/gsm8k")
    _check_reward(build_config(overrides=[f"data.train_files=[{good}]", "reward.function="]), "train")
    bad = _write(tmp_path / "bad.parquet", "my/own")
    with pytest.raises(ConfigError, match="my/own"):
        _check_reward(build_config(overrides=[f"data.train_files=[{bad}]", "reward.function="]), "train")
