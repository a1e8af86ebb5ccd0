"""The seams a multi-turn rollout will use: an engine result may end a turn on a stop string or token ("stop",
not truncated) and may mark tokens the policy did not sample (a tool's output) untrainable, which reaches the
batch's response_mask. Single-turn results (no mask) keep every response token."""

import threading

import pytest
import torch

from posttrain.agents.trajectory import Trajectory
from posttrain.parallel.shares import MEAN, SUM, ShareMetrics
from posttrain.rl.collect.generation import Scored, scored_batch
from posttrain.rl.collect.multi_turn import episode_metrics, step_metric_keys
from posttrain.rl.collect.truncation import mask_truncated
from posttrain.rollout.base import FINISH_REASONS, RolloutResult


def result(mask=None) -> RolloutResult:
    return RolloutResult(
        prompt_index=[0, 0, 1],
        response_ids=[[5, 6, 7, 8], [5, 6], [9, 9, 9]],
        response_logprobs=[[-0.1] * 4, [-0.2] * 2, [-0.3] * 3],
        finish_reasons=["stop", "eos", "length"],
        trainable_mask=mask,
    )


def test_trainable_mask_becomes_response_mask_and_the_score_sits_on_the_last_trained_token():
    mask = [[1, 0, 0, 1], [1, 1], [1, 1, 0]]
    batch = scored_batch(Scored(result(mask), torch.tensor([1.0, 2.0, 3.0])), [[1], [2, 3]], 0, None, False)
    assert batch.response_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert batch.token_level_scores.tolist() == [[0, 0, 0, 1.0], [0, 2.0, 0, 0], [0, 3.0, 0, 0]]


def test_without_a_mask_every_response_token_trains():
    batch = scored_batch(Scored(result(), torch.tensor([1.0, 2.0, 3.0])), [[1], [2, 3]], 0, None, False)
    assert batch.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert batch.token_level_scores[:, :].sum(-1).tolist() == [1.0, 2.0, 3.0]
    assert batch.token_level_scores[0, 3] == 1.0 and batch.token_level_scores[2, 2] == 3.0


def test_a_stop_is_not_a_truncation():
    assert "stop" in FINISH_REASONS
    r = result()
    batch = scored_batch(Scored(r, torch.zeros(3)), [[1], [2, 3]], 0, None, False)
    mask_truncated(batch, r.finish_reasons)
    assert batch.response_mask.sum(-1).tolist() == [4, 2, 0]


def test_subset_and_extend_keep_the_masks():
    masked, plain = result([[1, 0, 0, 1], [1, 1], [1, 1, 0]]), result()
    picked = masked.subset([2, 0], prompt_index=[0, 1])
    assert picked.trainable_mask == [[1, 1, 0], [1, 0, 0, 1]] and picked.prompt_index == [0, 1]
    assert plain.subset([1]).trainable_mask is None
    plain.extend(masked)
    assert plain.trainable_mask == [[1] * 4, [1] * 2, [1] * 3, [1, 0, 0, 1], [1, 1], [1, 1, 0]]


def test_a_mask_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="sample 1: trainable_mask has 3 entries for 2 tokens"):
        result([[1] * 4, [1] * 3, [1] * 3])


def test_every_rank_logs_every_ranks_step_metric_keys():
    """Ranks reduce metrics position by position: a step metric that only one rank's trajectories reported is
    logged (as 0) by the others too, once the keys are gathered."""
    ranks = [[{"tool_rows": 2.0}, {}], [{"chars": 5.0}]]  # each rank's trajectories' step metrics
    barrier, slots, names = threading.Barrier(2), [None, None], [None, None]

    def gather(rank):
        def all_gather_object(keys):
            slots[rank] = keys
            barrier.wait()
            return list(slots)

        return all_gather_object

    def rank_body(rank):
        episodes = [Trajectory(prompt_ids=[0], messages=[], step_metrics=m) for m in ranks[rank]]
        metrics = ShareMetrics()
        keys = step_metric_keys(episodes, gather(rank))
        episode_metrics(episodes, metrics, {"mean": MEAN, "sum": SUM}, len(episodes), (), keys)
        names[rank] = metrics

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(names[0].values) == sorted(names[1].values)
    assert names[0].values["env/tool_rows"] == 1.0 and names[0].values["env/chars"] == 0.0
    assert names[1].values["env/tool_rows"] == 0.0 and names[1].values["env/chars"] == 5.0
    assert names[0].how["env/chars"] == MEAN and names[0].weights["env/chars"] == 2
