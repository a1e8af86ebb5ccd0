"""Engines hand each sample over as it finishes (``generate``'s ``on_sample``): every sample once, equal to its
entry of the result, and on the slot-cache path over several scheduler steps rather than all at the end."""

import pytest
import torch

from posttrain.models.hf import load_causal_lm
from posttrain.rollout.base import RolloutResult, SamplingParams, generate_reporting, takes_on_sample
from posttrain.rollout.native.engine import NativeEngine
from posttrain.rollout.native.scheduler import Scheduler

PROMPTS = [[5, 9, 3], [7, 7, 8, 2, 11], [4], [12, 6, 6, 9]]
PARAMS = SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=3)


def reported_samples(
    engine, prompts=PROMPTS, params=PARAMS
) -> tuple[RolloutResult, dict[int, RolloutResult]]:
    seen: dict[int, RolloutResult] = {}

    def on_sample(index: int, sample: RolloutResult) -> None:
        assert index not in seen, f"sample {index} reported twice"
        seen[index] = sample

    return generate_reporting(engine, prompts, params, on_sample), seen


def assert_each_sample_once(result: RolloutResult, seen: dict[int, RolloutResult]) -> None:
    assert sorted(seen) == list(range(len(result)))
    for index, sample in seen.items():
        assert sample == result.subset([index]), index


@pytest.fixture
def model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir).float()


def test_the_slot_cache_path_reports_each_sample_when_the_scheduler_retires_it(model, monkeypatch):
    batches = []
    take = Scheduler.take_finished

    def spy(self):
        out = take(self)
        if out:
            batches.append(len(out))
        return out

    monkeypatch.setattr(Scheduler, "take_finished", spy)
    engine = NativeEngine(model, eos_token_ids=[1], pad_token_id=0, max_num_seqs=2, max_num_batched_tokens=16)
    result, seen = reported_samples(engine)
    assert_each_sample_once(result, seen)
    assert sum(batches) == len(result) and len(batches) > 1  # several steps, not all at the end
    plain = engine.generate(PROMPTS, PARAMS)  # the callback changes nothing
    assert plain == result


def test_the_fallback_path_reports_each_chunk_when_it_is_decoded(model):
    engine = NativeEngine(model, eos_token_ids=[1], pad_token_id=0, chunk_size=2, use_hf_forward=True)
    result, seen = reported_samples(engine)
    assert_each_sample_once(result, seen)
    assert result == engine.generate(PROMPTS, PARAMS)


def test_an_engine_without_on_sample_reports_every_sample_at_the_end():
    class Plain:
        def generate(self, prompt_ids, params, prompt_offset=0):
            n = params.n
            return RolloutResult(
                prompt_index=[i for i in range(len(prompt_ids)) for _ in range(n)],
                response_ids=[[prompt_offset + i, j] for i in range(len(prompt_ids)) for j in range(n)],
                response_logprobs=[[-1.0, -1.0]] * (len(prompt_ids) * n),
                finish_reasons=["length"] * (len(prompt_ids) * n),
            )

    assert not takes_on_sample(Plain())
    result, seen = reported_samples(Plain())
    assert len(result) == 8
    assert_each_sample_once(result, seen)


def test_prompt_offset_is_passed_through(model):
    engine = NativeEngine(model, eos_token_ids=[1], pad_token_id=0, max_num_seqs=4)
    seen = {}
    got = generate_reporting(engine, PROMPTS, PARAMS, lambda i, s: seen.__setitem__(i, s), prompt_offset=4)
    assert got == engine.generate(PROMPTS, PARAMS, prompt_offset=4)
    assert_each_sample_once(got, seen)
    assert torch.equal(torch.tensor(got.prompt_index), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
