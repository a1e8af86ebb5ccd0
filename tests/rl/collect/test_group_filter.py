"""Dynamic sampling (algorithm.filter_groups): which groups are kept, how the batch is filled and trimmed, the
metrics, the error when max_num_gen_batches runs out, and the seeds. A scripted engine makes every number exact;
tests/rl/test_dapo_training.py runs the same code in real training."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.errors import ConfigError
from posttrain.data.datasets import TokenizedPrompts
from posttrain.data.records import PromptRecord
from posttrain.data.sampler import PromptSampler
from posttrain.parallel.runtime import DistContext
from posttrain.rewards.overlong import OverlongBuffer
from posttrain.rl.collect.generation import Scorer, step_seed
from posttrain.rl.collect.group_filter import (
    GroupFilter,
    ScoredGroups,
    draw_groups,
    generation_salt,
    merge_batch_metrics,
    varied_groups,
)
from posttrain.rollout.base import RolloutResult, SamplingParams

MAX_TOKENS = 6


class ScriptedEngine:
    """Each sample's length is drawn from (seed, sample index); its tokens and log-probs name the sample."""

    def __init__(self) -> None:
        self.seeds: list[int] = []

    def generate(self, prompt_ids, params: SamplingParams, prompt_offset: int = 0) -> RolloutResult:
        self.seeds.append(params.seed)
        out = RolloutResult()
        for p, prompt in enumerate(prompt_ids):
            for j in range(params.n):
                g = torch.Generator().manual_seed(params.seed * 1000 + (prompt_offset + p) * params.n + j)
                length = int(torch.randint(1, params.max_tokens + 1, (1,), generator=g))
                ids = [prompt[0]] * length  # the prompt's first token: which record the sample answers
                out.extend(
                    RolloutResult(
                        prompt_index=[p],
                        response_ids=[ids],
                        response_logprobs=[[-float(prompt[0])] * length],
                        finish_reasons=["length" if length == params.max_tokens else "eos"],
                    )
                )
        return out


class LengthRunner:
    """Records whose ground truth is 'same' score 1 whatever the response; the others score its length's parity."""

    def score(self, inputs):
        rewards = [1.0 if i.ground_truth == "same" else float(len(i.response.split()) % 2) for i in inputs]
        return rewards, {"reward/num_failures": 0.0, "reward/time_s": 0.5}


class SpaceTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in ids]


def prompts(num: int = 16) -> TokenizedPrompts:
    """Even records are 'same' (always dropped), odd ones vary."""
    records = [PromptRecord(f"p{i}", "same" if i % 2 == 0 else "vary") for i in range(num)]
    return TokenizedPrompts(prompt_ids=[[100 + i] for i in range(num)], records=records, n_filtered=0)


def params_for(k: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, n=4, seed=step_seed(7, 3, generation_salt(k)))


def draw(flt, overlong=None, sampler=None, engine=None):
    engine = engine or ScriptedEngine()
    sampler = sampler or PromptSampler(16, 4, seed=0)
    scorer = Scorer(LengthRunner(), None, SpaceTokenizer(), overlong)
    drawn, metrics = draw_groups(engine, scorer, prompts(), sampler, params_for, flt, DistContext())
    return drawn, metrics.values  # one rank: the metrics as they are


def groups_of(values: list[list[float]], lengths: list[list[int]] | None = None) -> ScoredGroups:
    index = [g for g, v in enumerate(values) for _ in v]
    flat = [x for v in values for x in v]
    lens = [x for v in lengths for x in v] if lengths else [1] * len(flat)
    result = RolloutResult(
        prompt_index=index,
        response_ids=[[0] * n for n in lens],
        response_logprobs=[[0.0] * n for n in lens],
        finish_reasons=["eos"] * len(flat),
    )
    penalties = OverlongBuffer(4, 2, 1.0).penalties(lens)
    return ScoredGroups(list(range(len(values))), result, torch.tensor(flat), penalties)


def test_a_group_is_kept_when_its_metric_differs_or_it_has_one_sample():
    groups = groups_of([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0], [0.5]])
    assert varied_groups(groups, "acc") == [1, 3]


def test_acc_reads_the_reward_before_overlong_shaping_and_seq_reward_after():
    # Group 0: same reward, lengths 1 and 4 -> penalties 0 and -1: equal before shaping, different after.
    groups = groups_of([[1.0, 1.0], [0.0, 0.0]], lengths=[[1, 4], [2, 2]])
    assert varied_groups(groups, "acc") == varied_groups(groups, "score") == []
    assert varied_groups(groups, "seq_reward") == varied_groups(groups, "seq_final_reward") == [0]


def test_select_keeps_samples_scores_and_log_probs_together():
    engine = ScriptedEngine()
    result = engine.generate([[100], [101], [102]], params_for(0))
    groups = ScoredGroups([10, 11, 12], result, torch.arange(12.0), torch.zeros(12))
    picked = groups.select([2, 0])
    assert picked.rows == [12, 10]
    assert picked.result.prompt_index == [0] * 4 + [1] * 4
    assert [ids[0] for ids in picked.result.response_ids] == [102] * 4 + [100] * 4
    assert [lp[0] for lp in picked.result.response_logprobs] == [-102.0] * 4 + [-100.0] * 4
    assert picked.scores.tolist() == [8.0, 9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 3.0]
    picked.extend(groups.select([1]))
    assert picked.rows == [12, 10, 11] and picked.result.prompt_index[-4:] == [2] * 4


def test_the_batch_is_filled_with_varied_groups_and_trimmed_to_train_batch_size():
    sampler = PromptSampler(16, 4, seed=0)
    engine = ScriptedEngine()
    drawn, metrics = draw(GroupFilter("acc", 0, 4), sampler=sampler, engine=engine)
    assert drawn.num_groups == 4 and len(drawn.result) == 16
    assert varied_groups(drawn, "acc") == [0, 1, 2, 3]  # no group of the batch is all-equal
    assert all(prompts().records[r].ground_truth == "vary" for r in drawn.rows)
    batches = metrics["train/num_gen_batches"]
    assert batches >= 2  # half of every generation batch is 'same': one batch cannot fill the step
    assert metrics["filter_groups/num_kept"] + metrics["filter_groups/num_dropped"] == 4 * batches
    assert metrics["filter_groups/num_kept"] - metrics["filter_groups/num_surplus"] == 4
    # Each generation batch took the next prompts and its own seed; the first is the step's plain seed.
    assert sampler.state_dict()["position"] + 16 * sampler.state_dict()["epoch"] == 4 * batches
    assert engine.seeds == [params_for(k).seed for k in range(int(batches))]
    assert len(set(engine.seeds)) == batches and engine.seeds[0] == step_seed(7, 3)
    # Scoring metrics: counts and times add up over the batches, the rest is averaged.
    assert metrics["reward/time_s"] == pytest.approx(0.5 * batches)


def test_kept_groups_are_the_first_ones_drawn_in_order():
    one_batch = PromptSampler(16, 4, seed=0)
    first = [r for r in one_batch.next_batch() if r % 2 == 1]
    drawn, _ = draw(GroupFilter("acc", 0, 4))
    varied_in_first = [r for r in first if r in drawn.rows]
    assert drawn.rows[: len(varied_in_first)] == varied_in_first


def test_too_many_generation_batches_is_a_clear_error():
    with pytest.raises(
        ConfigError, match=r"algorithm.filter_groups.max_num_gen_batches=1: .* kept only \d of the 4"
    ):
        draw(GroupFilter("acc", 1, 4))


def test_without_a_filter_one_batch_is_drawn_unchanged():
    engine = ScriptedEngine()
    drawn, metrics = draw(None, engine=engine)
    assert drawn.num_groups == 4 and len(drawn.result) == 16 and engine.seeds == [step_seed(7, 3)]
    assert "train/num_gen_batches" not in metrics
    assert torch.equal(drawn.penalties, torch.zeros(16))


def test_overlong_penalties_follow_the_kept_samples():
    drawn, _ = draw(GroupFilter("seq_reward", 0, 4), overlong=OverlongBuffer(MAX_TOKENS, 3, 0.5))
    expected = OverlongBuffer(MAX_TOKENS, 3, 0.5).penalties(drawn.result.response_lengths)
    assert torch.equal(drawn.penalties, expected)
    assert torch.equal(drawn.rewards, drawn.scores + expected)


def test_same_seeds_draw_the_same_batch():
    a, ma = draw(GroupFilter("acc", 0, 4))
    b, mb = draw(GroupFilter("acc", 0, 4))
    assert a.rows == b.rows and a.result == b.result and torch.equal(a.scores, b.scores) and ma == mb


def test_batch_metrics_merge():
    merged = merge_batch_metrics(
        [{"reward/num_failures": 1.0, "x": 2.0}, {"reward/num_failures": 2.0, "x": 4.0}]
    )
    assert merged == {"reward/num_failures": 3.0, "x": 3.0}
