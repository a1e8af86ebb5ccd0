"""Partial rollouts (`async_training.partial_rollout`): the queue order fixes which weights start and finish
each response, a seed reproduces a run, nothing to continue is partial_rollout=false exactly, continued
responses are well formed (ids, a log-prob per token, finish reasons, eos), and what is not supported is
refused."""

import pytest
import torch

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.data.batch import build_rollout_batch
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer
from posttrain.rl.checks import check_async_training
from posttrain.rl.collect.context import GeneratedStep, StartedStep
from posttrain.rl.overlap.hosts import ThreadHost
from posttrain.rl.overlap.partial import continue_unfinished, partial_metrics, token_versions
from posttrain.rl.overlap.queue import RolloutQueue
from posttrain.rl.train_command import run_training
from posttrain.rollout.base import RolloutResult, SamplingParams
from posttrain.rollout.native.engine import NativeEngine
from tests.helpers import read_metrics, small_config
from tests.local_ray import local_ray

STEPS = ("trainer.total_steps=4", "trainer.export_hf=false")
COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")
PARTIAL = ("async_training.enable=true", "async_training.partial_rollout=true")


def _run(model_dir, run_dir, *extra):
    run_training(small_config(model_dir, run_dir, *STEPS, *extra), quiet=True)
    return read_metrics(run_dir)


def test_start_and_finish_follow_the_queue_order():
    """A stand-in worker on the thread host: start s runs after the load of version s-1-k, finish s after the
    load of version s-1, and the finish of step s is queued before the starts it lets through."""
    calls, k = [], 2

    class Worker:
        version = 0

        def start(self, step):
            calls.append(("start", step, self.version))
            return StartedStep({"before": step})

        def finish(self, step):
            calls.append(("finish", step, self.version))
            batch = build_rollout_batch([[1, 2]] * 2, [[3]] * 2, [0, 0], pad_token_id=0)
            batch.policy_versions = torch.full((2,), max(0, step - 1 - k))
            return GeneratedStep(batch, {}, {"before": step})

        def load(self, version, weights):
            calls.append(("load", version, version))
            self.version = version

        def ready(self):
            return 0

    ahead = RolloutQueue(ThreadHost(Worker()), k, start_step=0, total_steps=5, partial=True)
    try:
        for step in range(1, 6):
            _, metrics = ahead.take(step)
            assert metrics["async/policy_lag_max"] == min(step - 1, k)
            if step < 5:
                assert ahead.sampler_state_after(step) == {"before": step + 1}
            ahead.push(step, torch.nn.Linear(2, 2))
        ahead.drain()
    finally:
        ahead.close()
    order = [(kind, step) for kind, step, _ in calls]
    assert order == [
        ("start", 1), ("finish", 1), ("start", 2), ("start", 3), ("load", 1),
        ("finish", 2), ("start", 4), ("load", 2),
        ("finish", 3), ("start", 5), ("load", 3),
        ("finish", 4), ("load", 4),
        ("finish", 5), ("load", 5),
    ]  # fmt: skip
    for kind, step, version in calls:
        if kind == "start":
            assert version == max(0, step - 1 - k)
        elif kind == "finish":
            assert version == step - 1


class ScriptedEngine:
    """Emits token 10 + i at position i of a prompt's continuation, log-prob -i/10, and eos (2) at the
    position a prompt's first token asks for (its length in tokens, counted from the prompt's real start)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, params, prompt_offset=0):
        self.calls.append(([list(p) for p in prompt_ids], params, prompt_offset))
        out = RolloutResult()
        for p, prompt in enumerate(prompt_ids):
            for _ in range(params.n):
                stop_at, ids, lps = prompt[0], [], []
                why = "length"
                for _ in range(params.max_tokens):
                    pos = len(prompt) - 1 + len(ids)  # tokens generated so far for this response overall
                    tok = 2 if pos + 1 == stop_at else 10 + pos
                    ids.append(tok)
                    lps.append(-pos / 10)
                    if tok == 2:
                        why = "eos"
                        break
                out.extend(RolloutResult([p], [ids], [lps], [why]))
        return out


def test_continued_responses_on_a_hand_checked_case():
    """Four samples, P = 2, max 5: one ended on eos before P (kept), one ended on eos at exactly P (kept),
    one finishes on eos in its continuation, one runs to the cap. Ids, log-probs and reasons join exactly."""
    engine = ScriptedEngine()
    prompts = [[1], [2], [4], [9]]  # first token: the response position of eos (1-based), 9: never
    params = SamplingParams(max_tokens=2, seed=7)
    partial = engine.generate(prompts, params)
    assert partial.response_ids == [[2], [10, 2], [10, 11], [10, 11]]
    assert partial.finish_reasons == ["eos", "eos", "length", "length"]
    out, continued = continue_unfinished(engine, prompts, partial, 5, SamplingParams(max_tokens=1, seed=8))
    assert continued == [2, 3]
    resubmitted, cont_params, offset = engine.calls[-1]
    assert resubmitted == [[4, 10, 11], [9, 10, 11]] and cont_params.max_tokens == 3 and offset == 0
    assert cont_params.seed == 8 and cont_params.n == 1
    assert out.response_ids == [[2], [10, 2], [10, 11, 12, 2], [10, 11, 12, 13, 14]]
    assert out.response_logprobs[3] == [0.0, -0.1, -0.2, -0.3, -0.4]
    assert out.finish_reasons == ["eos", "eos", "eos", "length"]
    assert partial.response_ids[2] == [10, 11]  # the start's result is left as it was
    before, lengths = [1, 2, 2, 2], out.response_lengths
    versions = token_versions(5, before, lengths, started=3, finished=5)
    assert versions.tolist() == [
        [3, -1, -1, -1, -1],
        [3, 3, -1, -1, -1],
        [3, 3, 5, 5, -1],
        [3, 3, 5, 5, 5],
    ]
    # 2 of 4 continued; 5 of the 12 tokens came after the reload; the newest weights are version 5.
    assert partial_metrics(before, lengths, continued, 3, 5, newest=5) == {
        "async/partial_samples": 0.5,
        "async/tokens_continued": 5 / 12,
        "async/tokens_from_newest": 5 / 12,
    }
    assert partial_metrics(before, lengths, continued, 5, 5, newest=5)["async/tokens_from_newest"] == 1.0


def test_greedy_continuation_is_the_uninterrupted_response():
    """On a real engine, greedy: the first P tokens, then the rest resubmitted, give the uninterrupted
    response token for token (an early eos included), with one log-prob per token that agrees."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(
        tok, seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128, tie_word_embeddings=False
    )
    prompts = [tok.encode(t) for t in ("What is 1 + 2?", "Hello", "Count: 7 8 9", "The quick brown fox")]
    probe = NativeEngine(model, eos_token_ids=[2], pad_token_id=0)
    third = probe.generate(prompts, SamplingParams(max_tokens=3, greedy=True)).response_ids[1][2]
    engine = NativeEngine(model, eos_token_ids=[2, third], pad_token_id=0)  # prompt 1 stops at token 3
    whole = engine.generate(prompts, SamplingParams(max_tokens=8, greedy=True))
    partial = engine.generate(prompts, SamplingParams(max_tokens=3, greedy=True))
    out, continued = continue_unfinished(
        engine, prompts, partial, 8, SamplingParams(max_tokens=1, greedy=True)
    )
    assert 1 not in continued and len(continued) >= 2
    assert out.response_ids == whole.response_ids
    assert out.finish_reasons == whole.finish_reasons
    assert out.finish_reasons[1] == "eos" and len(out.response_ids[1]) == 3
    for ids, lps, why in zip(out.response_ids, out.response_logprobs, out.finish_reasons):
        assert len(lps) == len(ids) <= 8
        assert why == ("eos" if ids[-1] in (2, third) else "length")
        assert why == "eos" or len(ids) == 8
    for ours, theirs in zip(out.response_logprobs, whole.response_logprobs):
        assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=1e-4)


def test_a_seed_reproduces_a_partial_run_and_tokens_carry_their_versions(tiny_model_dir, tmp_path):
    extra = (*PARTIAL, "async_training.partial_rollout_tokens=3")
    first = _run(tiny_model_dir, tmp_path / "a", *extra)
    again = _run(tiny_model_dir, tmp_path / "b", *extra)
    keys = (*COMPARED, "async/policy_version", "async/partial_samples", "async/tokens_from_newest")
    for m, r in zip(first, again, strict=True):
        for key in keys:
            assert m[key] == r[key], (m["step"], key)
    for m in first:  # one step ahead: started with version s-2, finished with s-1 (step 1: 0 and 0)
        step = m["step"]
        assert m["async/policy_version"] == max(0, step - 2)
        assert m["async/policy_lag_max"] == min(step - 1, 1)
        assert m["response_length/max"] <= 6
        newest = 1.0 if step == 1 else m["async/tokens_continued"]
        assert m["async/tokens_from_newest"] == newest
    assert any(m["async/partial_samples"] > 0 for m in first)


def test_nothing_to_continue_is_partial_off_exactly(tiny_model_dir, tmp_path):
    whole = _run(tiny_model_dir, tmp_path / "whole", "async_training.enable=true")
    partial = _run(tiny_model_dir, tmp_path / "p", *PARTIAL, "async_training.partial_rollout_tokens=6")
    for w, p in zip(whole, partial, strict=True):
        for key in (*COMPARED, "async/policy_version", "async/policy_lag_max"):
            assert p[key] == w[key], (w["step"], key)
        assert p["async/partial_samples"] == 0.0 and p["async/tokens_continued"] == 0.0


def test_staleness_zero_samples_every_token_with_the_training_weights(tiny_model_dir, tmp_path):
    """k = 0: start and finish both run with the weights the step trains from, so every token's rollout
    log-prob is the trainer's (up to rounding): the continued tokens' log-probs sit where they belong."""
    extra = (*PARTIAL, "async_training.max_staleness=0", "async_training.partial_rollout_tokens=2")
    metrics = _run(tiny_model_dir, tmp_path / "k0", *extra)
    for m in metrics:
        assert m["async/tokens_from_newest"] == 1.0 and m["async/policy_lag_max"] == 0.0
        assert m["rollout_corr/log_prob_abs_diff_mean"] < 1e-4
    assert any(m["async/partial_samples"] > 0 for m in metrics)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["async_training.partial_rollout=true"],
            r"async_training.partial_rollout=true splits .* async_training.enable=false .* set "
            r"async_training.enable=true",
        ),
        (
            ["async_training.partial_rollout_tokens=4"],
            r"async_training.partial_rollout_tokens=4 .* async_training.partial_rollout=false .* set "
            r"async_training.partial_rollout=true",
        ),
        (
            [*PARTIAL, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
            r"partial_rollout=true with algorithm.filter_groups.enable=true: .* Set "
            r"algorithm.filter_groups.enable=false",
        ),
    ],
)
def test_what_partial_rollouts_do_not_support_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_async_training(build_config(overrides=overrides), 1)


def test_partial_rollouts_run_with_greedy_baselines(tiny_model_dir, tmp_path):
    """ReMax's greedy baselines are generated whole by the start, beside the partial responses."""
    extra = (*PARTIAL, "async_training.partial_rollout_tokens=2", "algorithm.adv_estimator=remax")
    metrics = _run(tiny_model_dir, tmp_path / "remax", *extra)
    assert all(m["async/partial_samples"] > 0 and m["response_length/max"] <= 6 for m in metrics)


@pytest.mark.timeout(600)
def test_a_ray_worker_runs_the_partial_rollouts_of_the_rollout_thread(tiny_model_dir, tmp_path):
    """The worker's started responses stay in its process between start and finish: a Ray-placed worker
    produces the thread's run."""
    pytest.importorskip("ray")
    extra = (*PARTIAL, "async_training.partial_rollout_tokens=3")
    thread = _run(tiny_model_dir, tmp_path / "thread", *extra)
    with local_ray(tmp_path, num_cpus=2):  # the run joins it (tests/local_ray.py: nothing is left behind)
        ray = _run(tiny_model_dir, tmp_path / "ray", *extra, "async_training.rollout_worker=ray")
    for t, r in zip(thread, ray, strict=True):
        for key in (*COMPARED, "async/policy_version", "async/partial_samples", "async/tokens_from_newest"):
            assert r[key] == t[key], (t["step"], key)


def test_the_plan_and_explain_give_the_tokens_generated_ahead():
    from rich.console import Console

    from posttrain.config.plan import build_plan
    from posttrain.planning.explain import plan_tree

    on = ("async_training.enable=true", "async_training.partial_rollout=true", "data.max_response_length=9")
    assert build_plan(build_config(overrides=list(on))).partial_rollout_tokens == 4  # half, rounded down
    cfg = build_config(overrides=[*on, "async_training.partial_rollout_tokens=3"])
    console = Console(width=200, record=True)
    console.print(plan_tree(cfg, build_plan(cfg)))
    assert (
        "partial rollouts: the first 3 token(s) of each response are generated ahead" in console.export_text()
    )
    assert build_plan(build_config(overrides=["async_training.enable=true"])).partial_rollout_tokens == 0
