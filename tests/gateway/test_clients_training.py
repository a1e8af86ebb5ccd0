"""Two GRPO steps with each client library's own agent code as the harness (tests/gateway/clients/), over the
tiny model: the calls are captured and trained. The tiny model writes nonsense, so its tool calls rarely parse;
tests/gateway/test_clients_scripted.py covers the libraries handling real tool calls."""

from pathlib import Path

import pytest

from posttrain.gateway import Gateway
from posttrain.rl.collect import harness_loop
from posttrain.rl.collect.harness_loop import HarnessLoop
from posttrain.rl.train_command import run_training
from tests.gateway.test_clients_scripted import CLIENTS
from tests.helpers import read_metrics, small_config

CLIENT_DIR = Path(__file__).parent / "clients"
EXAMPLE = Path(__file__).parents[2] / "examples" / "agents" / "openai_calculator_agent.py"
# Tool schemas put ~500 tokens of the tiny tokenizer into every prompt: room for them; calls kept short.
RUN = [
    "data.max_response_length=24",
    "rollout.multi_turn.max_tokens_per_turn=8",
    "rollout.max_model_len=1536",
    "data.train_batch_size=2",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=1",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "actor.log_prob_micro_batch_size_per_gpu=2",
]


class Captured:
    """Each rollout of a run (``HarnessLoop.generate``'s result) with what the gateway captured during it: each
    trajectory's calls by sample id (sample ids repeat from one step to the next)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.records: dict[int, list] = {}
        self.rollouts: list[tuple] = []
        captured, sample_of = self, {}

        class RecordingGateway(Gateway):
            def open_session(self, *, sample_id, **kw):
                session = super().open_session(sample_id=sample_id, **kw)
                sample_of[session.id] = sample_id
                return session

            def close_session(self, session_id):
                records = super().close_session(session_id)
                captured.records[sample_of[session_id]] = records
                return records

        generate = HarnessLoop.generate

        def recorded(loop, *args, **kwargs):
            captured.records = {}
            result = generate(loop, *args, **kwargs)
            captured.rollouts.append((result, captured.records))
            return result

        monkeypatch.setattr(harness_loop, "Gateway", RecordingGateway)
        monkeypatch.setattr(HarnessLoop, "generate", recorded)


def train(tiny_model_dir, tmp_path, monkeypatch, harness: str, *extra: str) -> tuple[list[dict], Captured]:
    captured = Captured(monkeypatch)
    run = tmp_path / "run"
    run_training(small_config(tiny_model_dir, run, f"harness.path={harness}", *RUN, *extra), quiet=True)
    return [step for step in read_metrics(run) if "actor/loss" in step], captured


def assert_trained_exactly_what_was_captured(captured: Captured) -> None:
    """Every sample's trained (mask 1) ids are its last chain's sampled ids, its prompt that chain's first prompt,
    and its whole token stream the last call's prompt + completion (cut at the trajectory budget)."""
    for result, calls in captured.rollouts:
        for s, traj in enumerate(result.episodes):
            records = calls[traj.sample_id]
            assert records, f"sample {traj.sample_id} made no call"
            k = len(records) - 1
            while records[k].extends_previous:
                k -= 1
            chain = records[k:]
            ids, mask = result.response_ids[s], result.trainable_mask[s]
            trained = [t for t, m in zip(ids, mask) if m]
            sampled = [t for r in chain for t in r.completion_ids]
            assert trained == sampled[: len(trained)] and len(trained) >= min(len(sampled), 1)
            assert result.prompt_ids[s] == chain[0].prompt_ids
            whole = chain[-1].prompt_ids + chain[-1].completion_ids
            assert chain[0].prompt_ids + ids == whole[: len(chain[0].prompt_ids) + len(ids)]


# smolagents re-renders its memory at each step (a prefix break) and ends with a final-answer call: its session's
# token budget counts those prompts' growth too, so it gets more room.
EXTRA = {"smolagents_agent": ["data.max_response_length=512"]}


@pytest.mark.parametrize("name", list(CLIENTS))
def test_two_grpo_steps_through_the_client_library(tiny_model_dir, tmp_path, monkeypatch, name):
    pytest.importorskip(CLIENTS[name])
    steps, captured = train(
        tiny_model_dir, tmp_path, monkeypatch, f"{CLIENT_DIR / name}.py:run", *EXTRA.get(name, [])
    )
    assert len(steps) == 2 and len(captured.rollouts) == 2
    for step in steps:
        failures = {k: v for k, v in step.items() if k.startswith("gateway/harness_failures/") and v}
        assert failures == {} and "env/tool_calls" in step and step["tokens/assistant"] > 0
    assert_trained_exactly_what_was_captured(captured)


def test_the_openai_calculator_example_trains(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("openai")
    over = ["trainer.total_steps=1", "data.task=arithmetic", "reward.function="]
    steps, captured = train(tiny_model_dir, tmp_path, monkeypatch, f"{EXAMPLE}:run", *over)
    assert len(steps) == 1 and steps[0]["gateway/harness_failures/raised"] == 0
    assert "env/tool_calls" in steps[0]
    assert_trained_exactly_what_was_captured(captured)
