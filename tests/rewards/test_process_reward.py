"""A process reward model as a reward: steps cut on text and placed on the sampled tokens, the reductions, the
combination with a rule, short GRPO and PPO runs, and bad keys (posttrain.rewards.process_reward)."""

import re

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification, Qwen2ForTokenClassification

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.data.batch import RolloutBatch
from posttrain.models.hf import load_tokenizer
from posttrain.planning.preflight import preflight
from posttrain.rewards.combine import RewardWeights, combine_rewards
from posttrain.rewards.process_reward import (
    ProcessReward,
    ProcessRewardScorer,
    dense_shift,
    reduce_steps,
    response_steps,
    split_steps,
    step_pattern,
)
from posttrain.rl.collect.generation import Scored, scored_batch
from posttrain.rl.train_command import run_training
from posttrain.rollout.base import RolloutResult
from tests.helpers import read_metrics, small_config

NL = step_pattern("\n", False)


def _prm(tmp_path, tiny_model_dir, separator="\n", arch=Qwen2ForTokenClassification, labels=2):
    tok = load_tokenizer(tiny_model_dir)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, num_labels=labels, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    config.step_separator = separator
    torch.manual_seed(0)
    path = tmp_path / "prm"
    arch(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_split_steps_no_separator_trailing_and_empty_steps():
    assert split_steps("1+1=2", NL) == [("1+1=2", 5)]
    assert split_steps("a\nb\n", NL) == [("a", 2), ("b", 4)]  # a trailing separator ends the last step
    assert split_steps("a\n\nb", NL) == [("a", 2), ("b", 4)]  # an empty step is no step
    assert split_steps("", NL) == []
    assert split_steps("x. y. z", step_pattern(r"\.\s*", True)) == [("x", 3), ("y", 6), ("z", 7)]


def _ends_text(tok, ids, ends):
    return [tok.decode(ids[: e + 1], skip_special_tokens=True) for e in ends]


def test_steps_end_on_the_token_that_completes_each_step(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    text = "3+4=7\n7*2=14\nso 14"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    steps = response_steps(ids, None, NL, tok)
    assert steps.texts == ["3+4=7", "7*2=14", "so 14"]
    decoded = _ends_text(tok, ids, steps.ends)
    assert decoded == ["3+4=7\n", "3+4=7\n7*2=14\n", text]  # each step with its separator, not one token more
    assert steps.ends[-1] == len(ids) - 2  # the last step's last text token; the eos carries no step
    none = tok("no separator here", add_special_tokens=False)["input_ids"]
    assert response_steps(none, None, NL, tok).ends == [len(none) - 1]  # one step: the whole response


def test_multi_turn_steps_only_in_trained_spans(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    said = tok("a=1\nb=2", add_special_tokens=False)["input_ids"]
    env = tok("\nenv says\nthings\n", add_special_tokens=False)["input_ids"]
    again = tok("c=3\n", add_special_tokens=False)["input_ids"]
    ids, mask = said + env + again, [1] * len(said) + [0] * len(env) + [1] * len(again)
    steps = response_steps(ids, mask, NL, tok)
    assert steps.texts == ["a=1", "b=2", "c=3"]  # the environment's lines are no steps
    assert all(mask[e] == 1 for e in steps.ends)
    assert steps.ends[1] == len(said) - 1 and steps.ends[2] == len(ids) - 1
    assert tok.decode(ids[len(said) + len(env) : steps.ends[2] + 1]) == "c=3\n"


def test_reductions():
    assert reduce_steps([0.2, 0.9, 0.5], "min") == 0.2
    assert reduce_steps([0.2, 0.9, 0.5], "last") == 0.5
    assert reduce_steps([0.2, 0.9, 0.4], "mean") == pytest.approx(0.5)
    assert reduce_steps([], "min") == 0.0


def test_the_prm_part_adds_with_its_weight():
    rule, prm = torch.tensor([1.0, 0.0]), torch.tensor([0.25, 0.75])
    total, _ = combine_rewards(rule, None, RewardWeights(rule=0.5, prm=2.0), None, prm)
    assert torch.equal(total, 0.5 * rule + 2.0 * prm)


def test_scores_are_read_at_each_separator_like_an_unbatched_forward(tiny_model_dir, tmp_path):
    prm = ProcessRewardScorer(_prm(tmp_path, tiny_model_dir), micro_batch_size=2)
    ids, positions = prm.encode("Q: 2+2?", ["2+2=4", "so 4"])
    sep = prm.tokenizer.encode("\n", add_special_tokens=False)
    assert [ids[p - len(sep) + 1 : p + 1] for p in positions] == [sep, sep]
    assert positions[-1] == len(ids) - 1
    prompts, steps = ["Q: 2+2?", "Q: 1?", "Q: x"], [["2+2=4", "so 4"], ["1"], []]
    batched = prm.score(prompts, steps)
    assert batched[2] == []  # no step, no score
    for p, s, got in zip(prompts, steps, batched):
        if s:
            one, where = prm.encode(p, s)
            probs = prm.model(input_ids=torch.tensor([one])).logits.softmax(-1)[0, where, 1]
            assert got == pytest.approx(probs.tolist(), abs=1e-5)


def test_an_input_past_the_prms_context_is_cut_and_its_late_steps_counted(tiny_model_dir, tmp_path):
    prm = ProcessRewardScorer(_prm(tmp_path, tiny_model_dir), micro_batch_size=2)
    steps = ["2+2=4", "4+4=8", "8+8=16", "16+16=32"]
    full_ids, full_positions = prm.encode("Add 2, 2, 4, 8, 16.", steps)
    whole = prm.score(["Add 2, 2, 4, 8, 16."], [steps])[0]
    prm.max_length = full_positions[1] + 1  # room for the first two steps' scores only
    ids, positions = prm.encode("Add 2, 2, 4, 8, 16.", steps)
    assert ids == full_ids[: prm.max_length] and positions == full_positions[:2]
    cut = prm.score(["Add 2, 2, 4, 8, 16."], [steps])[0]
    assert cut == pytest.approx(whole[:2], abs=1e-5)  # a causal PRM: the steps it reads score as before
    tok = load_tokenizer(tiny_model_dir)
    response = tok.encode("\n".join(steps), add_special_tokens=False)
    values, _, metrics = ProcessReward(prm, NL, "min").score(["Add 2, 2, 4, 8, 16."], [response], [None], tok)
    assert metrics["reward/prm/cut_steps"] == 2 and metrics["reward/prm/no_steps"] == 0
    assert float(values[0]) == pytest.approx(min(whole[:2]), abs=1e-5)


def test_dense_scores_move_to_the_step_ends_and_keep_the_sum(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    prm = ProcessReward(ProcessRewardScorer(_prm(tmp_path, tiny_model_dir)), NL, "dense")
    responses = ["a=1\nb=2\n", "no steps at all"]
    ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    values, placed, metrics = prm.score(["Q", "Q"], ids, [[1] * len(i) for i in ids], tok)
    assert [len(p) for p in placed] == [2, 1] and metrics["reward/prm/steps"] == 1.5
    assert values.tolist() == pytest.approx([sum(v for _, v in p) for p in placed])
    result = RolloutResult([0, 0], ids, [[0.0] * len(i) for i in ids], ["eos", "eos"], dense_rewards=placed)
    rule = torch.tensor([1.0, 0.0])
    batch: RolloutBatch = scored_batch(Scored(result, rule + values), [[5, 6]], tok.pad_token_id, None, False)
    scores = batch.token_level_scores
    for row, pairs in enumerate(placed):
        last = len(ids[row]) - 1  # the eos: the rule's reward stays there
        expected = torch.zeros(scores.shape[1])
        expected[last] += rule[row]
        for index, value in pairs:
            expected[index] += value
        assert torch.allclose(scores[row], expected, atol=1e-6)
        assert float(scores[row].sum()) == pytest.approx(float(rule[row] + values[row]), abs=1e-5)
    assert torch.equal(dense_shift([[]], torch.tensor([3]), 4), torch.zeros(1, 4))


def test_grpo_with_a_reduced_prm_and_a_rule(tiny_model_dir, tmp_path):
    prm = _prm(tmp_path, tiny_model_dir)
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", "reward.prm.enable=true", f"reward.prm.path={prm}",
        "reward.prm.reduction=min", "reward.rule_weight=0.5", "reward.prm.weight=2.0",
    )  # fmt: skip
    run_training(cfg, quiet=True)
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert row["reward/mean"] == pytest.approx(
            0.5 * row["reward/rule_mean"] + 2.0 * row["reward/prm/mean"], abs=1e-5
        )
        assert 0.0 < row["reward/prm/mean"] < 1.0 and row["reward/prm/steps"] >= 1.0 - 1e-6
        assert "reward/accuracy" not in row


def test_ppo_with_dense_step_rewards(tiny_model_dir, tmp_path, monkeypatch):
    import posttrain.rl.collect.generation as generation

    shifts = []

    def recording(placed, last, width):
        shifts.append(shift := dense_shift(placed, last, width))
        return shift

    monkeypatch.setattr(generation, "dense_shift", recording)
    prm = _prm(tmp_path, tiny_model_dir, separator=" ")
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", "algorithm.adv_estimator=gae", "reward.prm.enable=true",
        f"reward.prm.path={prm}", "reward.prm.separator=\\s+", "reward.prm.separator_is_regex=true",
    )  # fmt: skip
    run_training(cfg, quiet=True)
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and all("reward/prm/steps" in r and "critic/vpred_mean" in r for r in rows)
    # steps ended before the last token: rewards sat inside responses (the shift adds there, sums to 0)
    assert len(shifts) == 2 and all(bool((s > 0).any()) for s in shifts)
    assert all(torch.allclose(s.sum(-1), torch.zeros(len(s)), atol=1e-5) for s in shifts)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["reward.prm.enable=true", "reward.prm.path=DIR"], "reward.prm.reduction=dense with algorithm.adv_estimator=grpo"),
        (["reward.prm.enable=true", "reward.prm.reduction=min"], "needs reward.prm.path"),
        (["reward.prm.enable=true", "reward.prm.path=DIR", "reward.prm.reduction=min",
          "reward.prm.separator=(", "reward.prm.separator_is_regex=true"], "not a valid regular expression"),
        (["reward.prm.enable=true", "reward.prm.path=DIR", "reward.prm.reduction=min",
          "reward.prm.separator=\\s*", "reward.prm.separator_is_regex=true"], "matches the empty string"),
        (["reward.prm.enable=true", "reward.prm.path=DIR", "reward.prm.reduction=sum"], "reward.prm.reduction"),
        (["reward.prm.enable=true", "reward.prm.path=DIR", "reward.prm.reduction=min",
          "reward.prm.weight=0", "reward.rule_weight=0"], "nothing to train on"),
        (["reward.rule_weight=0.5"], "reward.prm.enable=false"),
    ],
)  # fmt: skip
def test_bad_prm_keys_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=re.escape(match) if "(" not in match else match):
        build_config(overrides=overrides)


@pytest.mark.parametrize("kind", ["missing", "sequence_classifier", "three_labels"])
def test_a_wrong_prm_directory_stops_before_any_model_loads(tiny_model_dir, tmp_path, kind, monkeypatch):
    if kind == "missing":
        path, match = tmp_path / "nowhere", "is not a directory"
    elif kind == "sequence_classifier":
        path = _prm(tmp_path, tiny_model_dir, arch=Qwen2ForSequenceClassification, labels=1)
        match = "not a token classifier"
    else:
        path, match = _prm(tmp_path, tiny_model_dir, labels=3), "num_labels=3"
    import posttrain.rl.build as build

    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before the PRM's directory was checked")

    monkeypatch.setattr(build, "build_policy", no_load)
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", "reward.prm.enable=true", f"reward.prm.path={path}",
        "reward.prm.reduction=mean",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=match):
        run_training(cfg, quiet=True)
    with pytest.raises(ConfigError, match=match):  # what the command line checks first
        preflight(cfg, "train")
