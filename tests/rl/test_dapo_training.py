"""DAPO in real training on the tiny model: dynamic sampling fills each step with varied groups, counts what it
dropped, is reproducible and resumes exactly; overlong shaping and truncation masking act on the right samples."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from posttrain.config.errors import ConfigError
from posttrain.models.hf import load_causal_lm, save_hf
from posttrain.rewards.overlong import OverlongBuffer
from posttrain.rl.collect import source as rollout_source
from posttrain.rl.train_command import run_training
from posttrain.utils.metrics import read_metrics
from tests.helpers import crash_and_resume, small_config

# Prompts with an even answer score 1 whatever the response (their groups are all-equal and dropped); the
# others score the parity of the response's length, which varies between samples.
HALF_REWARD = """
def half(prompt, response, ground_truth, extra):
    return 1.0 if int(ground_truth) % 2 == 0 else float(len(response) % 2)


def constant(prompt, response, ground_truth, extra):
    return 0.0
"""
FILTER = ["algorithm.filter_groups.enable=true", "trainer.export_hf=false"]
ACC = [*FILTER, "algorithm.filter_groups.metric=acc"]
MAX_LEN = 6  # small_config's data.max_response_length


@pytest.fixture
def reward(tmp_path):
    path = tmp_path / "dapo_reward.py"
    path.write_text(HALF_REWARD)
    return lambda name: f"reward.function={path}:{name}"


@pytest.fixture
def batches(monkeypatch):
    """Every step's batch as the rollout phase built it (response mask copied before later phases run)."""
    seen = []
    original = rollout_source.rollout_phase

    def capture(c, step, timer):
        batch, metrics = original(c, step, timer)
        seen.append((batch, batch.response_mask.clone(), metrics))
        return batch, metrics

    monkeypatch.setattr(rollout_source, "rollout_phase", capture)
    return seen


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with an eos logit that is large in some contexts, so some responses end before the limit
    and others are cut off at it."""
    model = load_causal_lm(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.get_output_embeddings().weight[tokenizer.eos_token_id] = 2.0 * direction / direction.norm()
    out = tmp_path_factory.mktemp("eos_model")
    save_hf(model, tokenizer, out)
    return out


def group_values(batch):
    scores = batch.token_level_scores.sum(-1)
    return {int(g): scores[batch.group_ids == g].tolist() for g in batch.group_ids.unique()}


def test_each_step_is_filled_with_varied_groups(tiny_model_dir, tmp_path, reward, batches):
    run_training(small_config(tiny_model_dir, tmp_path / "run", *ACC, reward("half")), quiet=True)
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for (batch, _, _), m in zip(batches, metrics):
        groups = group_values(batch)
        assert len(groups) == 4 and batch.num_rows == 16  # data.train_batch_size groups of rollout.n
        assert all(max(v) > min(v) for v in groups.values())  # none of them all-equal
        used = m["train/num_gen_batches"]
        assert used >= 2  # about half the prompts of every generation batch are all-equal
        assert m["filter_groups/num_kept"] + m["filter_groups/num_dropped"] == 4 * used
        assert m["filter_groups/num_kept"] - m["filter_groups/num_surplus"] == 4
        assert m["reward/mean"] == pytest.approx(float(batch.token_level_scores.sum() / 16))


def test_same_seed_same_run(tiny_model_dir, tmp_path, reward):
    def run(name):
        run_training(small_config(tiny_model_dir, tmp_path / name, *ACC, reward("half")), quiet=True)
        return [
            {
                k: v
                for k, v in m.items()
                if not k.startswith(("timing/", "perf/", "reward/time_s", "reward/wait_s"))
            }
            for m in read_metrics(tmp_path / name / "metrics.jsonl")
        ]

    assert run("a") == run("b")


def test_resume_draws_what_the_uninterrupted_run_drew(tiny_model_dir, tmp_path, monkeypatch, reward):
    keys = ("reward/mean", "train/num_gen_batches", "filter_groups/num_dropped", "actor/pg_loss")
    crash_and_resume(tiny_model_dir, tmp_path, monkeypatch, (*ACC, reward("half")), keys)


def test_running_out_of_generation_batches_names_the_key(tiny_model_dir, tmp_path, reward):
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        *ACC,
        reward("constant"),
        "algorithm.filter_groups.max_num_gen_batches=3",
    )
    with pytest.raises(ConfigError, match=r"max_num_gen_batches=3: .*kept only 0 of the 4 .* 12 groups"):
        run_training(cfg, quiet=True)


def test_overlong_shaping_and_truncation_masking_act_on_the_right_samples(
    eos_model_dir, tmp_path, reward, batches
):
    extra = [
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=3",
        "reward.overlong_buffer.penalty_factor=0.5",
        "reward.overlong_buffer.log=true",
        "algorithm.mask_truncated_samples=true",
        "algorithm.filter_groups.metric=seq_reward",
    ]
    run_training(small_config(eos_model_dir, tmp_path / "run", *FILTER, reward("half"), *extra), quiet=True)
    eos = AutoTokenizer.from_pretrained(eos_model_dir).eos_token_id
    total_masked = 0
    for batch, mask, metrics in batches:
        lengths = batch.attention_mask[:, batch.prompt_width :].sum(-1)
        last = batch.input_ids[torch.arange(batch.num_rows), batch.prompt_width + lengths - 1]
        truncated = last != eos  # a response that does not end on eos was cut off at the limit
        assert (lengths[truncated] == MAX_LEN).all()
        assert (mask.sum(-1) == 0).tolist() == truncated.tolist()  # exactly the truncated rows are masked
        assert metrics["finish/num_masked_truncated"] == truncated.sum()
        total_masked += int(truncated.sum())
        penalties = OverlongBuffer(MAX_LEN, 3, 0.5).penalties(lengths)
        assert metrics["reward/overlong_penalty_mean"] == pytest.approx(float(penalties.mean()))
        assert metrics["reward/overlong_fraction"] == pytest.approx(float((penalties < 0).float().mean()))
        assert all(max(v) > min(v) for v in group_values(batch).values())
    assert 0 < total_masked < sum(b.num_rows for b, _, _ in batches)  # the model gives both kinds


def test_remax_baselines_follow_the_kept_groups(tiny_model_dir, tmp_path, reward, batches):
    run_training(
        small_config(tiny_model_dir, tmp_path / "run", *ACC, reward("half"), "algorithm.adv_estimator=remax"),
        quiet=True,
    )
    for batch, _, metrics in batches:
        assert metrics["train/num_gen_batches"] >= 2
        for g in batch.group_ids.unique():
            baseline = batch.reward_baselines[batch.group_ids == g]
            assert (baseline == baseline[0]).all()  # one greedy response per kept prompt
