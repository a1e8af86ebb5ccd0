"""A judge loaded in the process (reward.judge.path), with the tiny real Qwen2 of the fixtures: batched verdicts
equal one-at-a-time ones and a plain generate's, the scorer's metrics over it, the config's rules, and a short
training run judged by it."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from posttrain.cli import main
from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.rewards.judge.local import LocalJudge
from posttrain.rewards.judge.rubric import load_rubric, render
from posttrain.rewards.judge.scorer import JudgeScorer
from posttrain.rewards.runner import RewardInput
from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, small_config, small_overrides

RUBRIC = """\
criteria:
  - name: short
    template: "{prompt}\\n{response}\\nScore 0-10 for brevity. End with VERDICT: <0-10>."
  - name: polite
    verdict: yes_no
    template: "{response}\\nIs it polite? End with VERDICT: yes or no."
"""

QUESTIONS = [
    [{"role": "user", "content": "Is 2+2=4? Answer yes or no."}],
    [{"role": "system", "content": "You grade answers."}, {"role": "user", "content": "Grade: hello"}],
    [
        {
            "role": "user",
            "content": "A much longer question, so that the batch is padded on the left side " * 3,
        }
    ],
    [{"role": "user", "content": "x"}],
    [{"role": "user", "content": "Say VERDICT: 7"}],
]


def write_rubric(tmp_path):
    path = tmp_path / "rubric.yaml"
    path.write_text(RUBRIC)
    return path


def test_batched_verdicts_equal_one_at_a_time_and_a_plain_generate(tiny_model_dir):
    batched = LocalJudge(tiny_model_dir, max_tokens=12, batch_size=4)
    alone = LocalJudge(tiny_model_dir, max_tokens=12, batch_size=1)
    many = batched.chat_many(QUESTIONS)  # a batch of 4 (left-padded), then one of 1
    ones = [alone.chat(q) for q in QUESTIONS]
    assert [a.text for a in many] == [a.text for a in ones]
    assert [a.tokens for a in many] == [a.tokens for a in ones]
    tokenizer, model = alone.tokenizer, alone.model
    for question, answer in zip(QUESTIONS, ones):
        ids = tokenizer(alone.render(question), return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )[0, ids.shape[1] :].tolist()
        if tokenizer.eos_token_id in out:
            out = out[: out.index(tokenizer.eos_token_id) + 1]
        assert answer.text == tokenizer.decode(out, skip_special_tokens=True)
        assert answer.tokens == ids.shape[1] + len(out)
    assert batched.url == f"local:{tiny_model_dir}" and batched.max_retries == 0


def test_calls_from_several_threads_answer_as_one_thread_does(tiny_model_dir):
    judge = LocalJudge(tiny_model_dir, max_tokens=6)
    alone = [judge.chat(q) for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        assert list(pool.map(judge.chat, QUESTIONS)) == alone


def test_the_chat_template_and_its_plain_fallback(tiny_model_dir):
    judge = LocalJudge(tiny_model_dir, max_tokens=2)
    assert judge.render(QUESTIONS[1]).endswith("<|im_start|>assistant\n")  # the tiny tokenizer's ChatML
    judge.tokenizer.chat_template = None
    assert judge.render(QUESTIONS[1]) == "system: You grade answers.\nuser: Grade: hello\nassistant:"
    assert judge.chat(QUESTIONS[1]).tokens > 0


def test_the_scorer_over_a_local_judge_counts_calls_tokens_cache_and_unparsed(tiny_model_dir, tmp_path):
    judge = LocalJudge(tiny_model_dir, max_tokens=4, batch_size=3)
    scorer = JudgeScorer(judge, load_rubric(str(write_rubric(tmp_path))), unparsed_score=0.25)
    samples = [RewardInput("Say hi.", r, None, {}) for r in ("hi", "hello there", "hi")]
    scores, metrics = scorer.score(samples)
    # 2 distinct responses x 2 criteria asked; the repeated "hi" reuses its verdicts
    assert metrics["reward/judge/calls"] == 4 and metrics["reward/judge/cached"] == 2
    # a random tiny model writes no verdict: every question is unparsed, scored 0.25, and counted
    assert metrics["reward/judge/unparsed"] == 6 and metrics["reward/judge/failures"] == 0
    assert scores == [0.25, 0.25, 0.25]
    fresh = [q for s in samples[:2] for q in scorer_questions(scorer, s)]
    # prompt + generated tokens of each fresh question; near, not equal: each render draws new delimiter tags
    expected = sum(a.tokens for a in judge.chat_many(fresh))
    assert metrics["reward/judge/tokens"] == pytest.approx(expected, rel=0.05)
    _, again = scorer.score(samples)
    assert again["reward/judge/calls"] == 0 and again["reward/judge/cached"] == 6
    assert again["reward/judge/tokens"] == 0


def scorer_questions(scorer, sample):
    """The messages the scorer sends about ``sample``, one per criterion."""
    return [
        render(scorer.rubric, c, sample.prompt, sample.response, sample.ground_truth, sample.extra)
        for c in scorer.rubric.criteria
    ]


def local_keys(tmp_path, *extra):
    return ["reward.judge.enable=true", f"reward.judge.rubric={write_rubric(tmp_path)}", *extra]


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            [
                "reward.judge.base_url=http://127.0.0.1:9/v1",
                "reward.judge.model=j",
                "reward.judge.path=builtin:base",
            ],
            "exactly one of reward.judge.base_url .* are both set",
        ),
        ([], "exactly one of reward.judge.base_url .* are both empty"),
        (
            ["reward.judge.path=builtin:base", "reward.judge.api_key_env=SOME_KEY"],
            "reward.judge.api_key_env='SOME_KEY' names an API key, but reward.judge.path",
        ),
        (["reward.judge.path=builtin:base", "reward.judge.batch_size=0"], "reward.judge.batch_size"),
    ],
)
def test_bad_local_judge_keys(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=local_keys(tmp_path, *extra))


def test_a_missing_judge_path_stops_before_any_model_loads(tiny_model_dir, tmp_path, capsys):
    missing = tmp_path / "no-judge"
    keys = small_overrides(
        tiny_model_dir, tmp_path / "run", *local_keys(tmp_path, f"reward.judge.path={missing}")
    )
    with pytest.raises(ConfigError, match=f"reward.judge.path='{missing}' is neither a model directory"):
        run_training(build_config(overrides=keys), quiet=True)
    assert main(["train", *keys]) == 2
    err = capsys.readouterr().err
    assert "reward.judge.path=" in err and "Traceback" not in err


def test_a_run_judged_by_a_local_model(tiny_model_dir, tmp_path):
    """The tiny policy judged by itself: its verdicts do not parse, so the judge's part is unparsed_score."""
    run = tmp_path / "run"
    keys = local_keys(
        tmp_path,
        f"reward.judge.path={tiny_model_dir}",
        "reward.judge.max_tokens=3",
        "reward.judge.batch_size=8",
        "reward.judge.unparsed_score=0.5",
        "reward.rule_weight=0.5",
    )
    run_training(small_config(tiny_model_dir, run, *keys), quiet=True)
    steps = read_metrics(run)
    assert len(steps) == 2
    for step in steps:
        assert step["reward/judge/score_mean"] == pytest.approx(0.5)
        assert step["reward/mean"] == pytest.approx(0.5 * step["reward/rule_mean"] + 0.5, abs=1e-5)
        asked = step["reward/judge/calls"] + step["reward/judge/cached"]
        assert asked == 32  # 4 prompts x 4 samples x 2 criteria
        assert step["reward/judge/unparsed"] == 32 and step["reward/judge/failures"] == 0
        assert step["reward/judge/tokens"] > 0 and "timing/judge" in step
