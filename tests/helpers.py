"""Helpers shared by several test modules: small run configs, reading a run's metrics, a crash-and-resume
scenario, gradient capture, the tool tasks' one-problem learning runs. (Fixtures live in conftest.py.)"""

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

from posttrain.agents.demos import demonstrations, write_jsonl
from posttrain.agents.driver import Generation, MultiTurnSettings
from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.config.load import build_config
from posttrain.config.schema import ActorConfig
from posttrain.config.schema.agents import MultiTurnConfig
from posttrain.data.records import PromptRecord
from posttrain.rl import train_command as rl
from posttrain.rl.collect.generation import Scored, scored_batch
from posttrain.rl.train_command import run_training
from posttrain.sft.command import run_sft_command
from posttrain.train.checkpoint import list_checkpoints
from posttrain.train.losses import actor_loss_fn


def tiny_qwen2_config(vocab_size: int, **overrides) -> Qwen2Config:
    """The tiny Qwen2 the unit tests build: hidden 32, MLP 64, 2 layers, 4 heads / 2 KV heads, tied embeddings
    (``overrides`` change or add any field)."""
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return Qwen2Config(**{**fields, **overrides})


REWARD_FILE = """
def varied(prompt, response, ground_truth, extra):
    # An untrained model is never right; reward something it varies in, so every group has signal.
    return float(len(response) % 3) + (1.0 if ground_truth and ground_truth in response else 0.0)
"""


def scripted(tok, policy, logprob: float = 0.0):
    """A deterministic "engine" for the multi-turn driver: ``policy(conversation text)`` gives the reply,
    sampled as its canonical tokens plus eos, cut at the request's token limit (finish "length" then)."""

    def generate(requests):
        out = []
        for r in requests:
            reply = tok(policy(tok.decode(r.ids)), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            cut = reply[: r.max_tokens]
            out.append(Generation(cut, [logprob] * len(cut), "stop" if len(cut) == len(reply) else "length"))
        return out

    return generate


def multi_turn_settings(max_response_length: int = 512, **keys) -> MultiTurnSettings:
    """The driver's settings: a `rollout.multi_turn` section with ``keys`` set (the schema's defaults for the
    rest) and a trajectory budget of ``max_response_length`` tokens."""
    return MultiTurnSettings(MultiTurnConfig(**keys), max_response_length)


def small_config(model_dir, run_dir, *extra):
    return build_config(overrides=small_overrides(model_dir, run_dir, *extra))


def small_overrides(model_dir, run_dir, *extra):
    """The command-line overrides of :func:`small_config` (for tests that run the CLI)."""
    reward = run_dir.parent / "varied_reward.py"
    reward.write_text(REWARD_FILE)
    return [
        f"model.path={model_dir}",
        f"trainer.run_dir={run_dir}",
        "trainer.loggers=jsonl",
        "trainer.total_steps=2",
        "trainer.test_freq=0",
        "data.num_train_examples=64",
        "data.num_val_examples=8",
        "data.train_batch_size=4",
        "data.max_response_length=6",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_gpu=4",
        "actor.log_prob_micro_batch_size_per_gpu=5",
        "actor.optim.lr=1e-3",
        "critic.ppo_mini_batch_size=2",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "critic.forward_micro_batch_size_per_gpu=7",
        "critic.optim.lr=1e-3",
        "reward.timeout_s=0",
        f"reward.function={reward}:varied",
        *extra,
    ]


def untimed(step: dict) -> dict:
    """A step's metrics without those that measure time, which differ between any two runs of the same step
    (``timing/*``, ``perf/*``, seconds ``*_s``, rates ``*_per_s``, ``elapsed``)."""
    timed = ("timing/", "perf/")
    return {k: v for k, v in step.items() if not (k.startswith(timed) or k.endswith(("_s", "elapsed")))}


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def crash_and_resume(model_dir, tmp_path, monkeypatch, extra, keys):
    """A 4-step run in ``full``; the same run in ``resumed`` crashing at step 3 (after the step-2 checkpoint) and
    started again. Steps 3-4 must report the same ``keys``. Returns the resumed run's config."""
    extra = (*extra, "trainer.total_steps=4", "trainer.save_freq=2", "actor.optim.lr_schedule=cosine")
    run_training(small_config(model_dir, tmp_path / "full", *extra), quiet=True)
    original = rl.train_step

    def crash_at_3(c, step, timer, source=None):
        if step == 3:
            raise RuntimeError("simulated crash")
        return original(c, step, timer, source)

    monkeypatch.setattr(rl, "train_step", crash_at_3)
    cfg = small_config(model_dir, tmp_path / "resumed", *extra)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg, quiet=True)
    assert [p.name for p in list_checkpoints(tmp_path / "resumed")] == ["step_000002"]
    monkeypatch.setattr(rl, "train_step", original)
    run_training(cfg, quiet=True)
    full = {m["step"]: m for m in read_metrics(tmp_path / "full")}
    resumed = {m["step"]: m for m in read_metrics(tmp_path / "resumed")}
    for step in (3, 4):
        for key in keys:
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-6, abs=1e-7), (step, key)
    return cfg


def sft_config(model_dir, tmp_path, *extra):
    rows = [{"prompt": f"What is {i} + 1?", "response": str(i + 1)} for i in range(16)]
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return build_config(
        overrides=[
            f"model.path={model_dir}",
            f"trainer.run_dir={tmp_path / 'run'}",
            f"sft.train_files=[{data}]",
            "sft.batch_size=8",
            "sft.micro_batch_size_per_gpu=4",
            "sft.epochs=3",
            "sft.optim.lr=3e-3",
            *extra,
        ]
    )


def sft_warm_start(run_dir, demos, steps: int, seed: int, *extra) -> Path:
    """SFT of ``builtin:base`` on a jsonl of demonstration conversations (the agent tasks' warm start, as
    benchmarks/agent_tasks.py makes it): batches of 32, one micro-batch each, ``steps`` steps; returns the model."""
    cfg = build_config(
        overrides=[
            "model.path=builtin:base",
            f"sft.train_files=[{demos}]",
            "data.prompt_key=messages",
            "sft.response_key=",
            "sft.batch_size=32",
            "sft.micro_batch_size_per_gpu=32",
            "sft.epochs=1",
            f"sft.max_steps={steps}",
            "trainer.test_freq=0",
            f"trainer.seed={seed}",
            f"trainer.run_dir={run_dir}",
            *extra,
        ]
    )
    run_sft_command(cfg, quiet=True)
    return Path(run_dir) / "sft_model"


def one_problem_file(record: PromptRecord, path: Path, rows: int = 32) -> Path:
    """A prompt file with ``record`` in each of its ``rows`` rows (prompt, answer and the record's extra fields): the
    tool tasks' short learning tests play one problem, as guess_number's CI test plays one game."""
    row = {"prompt": record.prompt, "answer": record.ground_truth, **record.extra}
    path.write_text((json.dumps(row) + "\n") * rows)
    return path


def one_problem_warm_start(
    tmp_path, task: str, record: PromptRecord, seed: int, *lengths, no_tool_rate: float | None = None
) -> Path:
    """The short tests' warm start: 40 SFT steps of 32 demonstrations of ``record`` (a share ``no_tool_rate``, by
    default half, answer from memory with a wrong number) at lr 3e-3, 5 warm-up steps, cosine to 3e-4
    (docs/agents.md, "The short test")."""
    rows = demonstrations(task, [record], 40 * 32, seed, no_tool_rate)
    demos = write_jsonl(rows, tmp_path / "demos.jsonl")
    schedule = ["sft.optim.lr=3e-3", "sft.optim.warmup_steps=5", "sft.optim.lr_schedule=cosine"]
    return sft_warm_start(
        tmp_path / "sft", demos, 40, seed, *lengths, *schedule, "sft.optim.min_lr_ratio=0.1"
    )


def one_problem_grpo(rows: Path, reward: str) -> list[str]:
    """The short tests' GRPO overrides on the rows of :func:`one_problem_file`: 8 steps of 16 x 8 samples (two
    optimizer steps each), 32 sampled validation trajectories at steps 0 and 8. Temperature 0.5: at 1 the 40-step
    warm start garbles its 70-token call and GRPO learns to answer from memory instead."""
    return [
        f"data.train_files=[{rows}]",
        f"data.val_files=[{rows}]",
        f"reward.function={reward}",
        "rollout.temperature=0.5",
        "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=8",
        "data.num_val_examples=32",
        "trainer.total_steps=8",
        "trainer.test_freq=8",
    ]


# The tool tasks' GRPO settings (benchmarks/agent_tasks.py: COMMON_GRPO and the task's GRPO entry).
TOOL_TASK_GRPO = [
    "algorithm.adv_estimator=grpo",
    "rollout.n=8",
    "rollout.multi_turn.max_assistant_turns=3",
    "rollout.multi_turn.max_tokens_per_turn=96",
    "actor.ppo_micro_batch_size_per_gpu=32",
    "actor.optim.lr=2e-4",
    "actor.optim.warmup_steps=5",
    "actor.loss_agg_mode=seq-mean-token-mean",
    "rollout.val_greedy=false",
    "trainer.loggers=[jsonl]",
]


# The full (benchmark-marked) runs: 40 GRPO steps of 16 prompts, 128 held-out problems validated every 10 steps.
HELD_OUT_GRPO = [
    "data.train_batch_size=16",
    "actor.ppo_mini_batch_size=8",
    "data.num_val_examples=128",
    "trainer.total_steps=40",
    "trainer.test_freq=10",
]


def tool_task_curve(task: str, model, run_dir, seed: int, *overrides) -> list[tuple[float, float]]:
    """GRPO on the built-in tool ``task`` from ``model``; the success and tool-call rate of each validation."""
    extra = [f"model.path={model}", f"trainer.seed={seed}", f"trainer.run_dir={run_dir}"]
    run_training(
        build_config(overrides=[f"data.task={task}", *TOOL_TASK_GRPO, *overrides, *extra]), quiet=True
    )
    return validation_curve(run_dir)


def validation_curve(run_dir) -> list[tuple[float, float]]:
    """The held-out success and tool-call rate of each validation of a run."""
    rows = [row for row in read_metrics(run_dir) if "val/accuracy" in row]
    return [(row["val/accuracy"], row["val/tool_call_frequency"]) for row in rows]


def sft_cli_args(run, model_dir, rows: int = 8) -> list[str]:
    """`posttrain sft` arguments for a short run into ``run`` (its data file written beside it)."""
    data = run.parent / "sft.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": f"What is {i} + 1?", "response": str(i + 1)}) for i in range(rows))
    )
    return [
        f"model.path={model_dir}",
        f"trainer.run_dir={run}",
        f"sft.train_files=[{data}]",
        "sft.batch_size=4",
        "sft.micro_batch_size_per_gpu=4",
        "sft.epochs=1",
        "trainer.loggers=jsonl",
    ]


def rm_cli_args(run, model_dir, *extra) -> list[str]:
    """`posttrain rm` arguments for a short run into ``run`` (4 steps of 4 pairs, a checkpoint and a validation
    every 2; its pairs written beside it)."""
    train, val = run.parent / "pairs.jsonl", run.parent / "val_pairs.jsonl"
    rows = [{"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i)} for i in range(20)]
    train.write_text("\n".join(json.dumps(r) for r in rows[:16]))
    val.write_text("\n".join(json.dumps(r) for r in rows[16:]))
    return [
        f"model.path={model_dir}",
        f"trainer.run_dir={run}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "rm.batch_size=4",
        "rm.micro_batch_size_per_gpu=2",
        "rm.max_steps=4",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.loggers=jsonl",
        *extra,
    ]


class GradCapture(torch.optim.Optimizer):
    """An optimizer whose step records the accumulated gradient (and leaves the weights alone)."""

    def __init__(self, params):
        super().__init__(list(params), {})
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None):
        self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]


FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7


def assert_fp32_close(actual, expected, *, ulps: float = 64, msg: str = ""):
    """Equivalence tests say which kind they are. *Bit-exact* ones use ``torch.equal``: the same kernels on the
    same shapes in the same order, so the result cannot depend on the CPU. *fp32-close* ones use this: the same
    maths in another order of float32 operations (another width, kernel, matmul blocking or reduction order;
    the CPU's instruction set changes all of these: AVX-512, AVX2 and the scalar kernels round differently).
    Rounding error in a sum scales with its terms, not its result, so every element may differ by ``ulps``
    float32 epsilons of the tensor's largest magnitude (seen: up to 6 on AVX2 for a 2-layer model's
    gradients; the default leaves 10x room)."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    atol = ulps * FP32_EPS * max(scale, torch.finfo(torch.float32).tiny)
    torch.testing.assert_close(
        actual,
        expected,
        rtol=0,
        atol=atol,
        msg=lambda m: f"{msg} (fp32-close, {ulps} ulps of {scale:.3g}): {m}",
    )


def assert_grads_equal(grads, ref, what):
    assert any(float(g.abs().max()) > 1e-4 for g in ref), (
        "reference gradient is zero: the test would be vacuous"
    )
    for i, (g, r) in enumerate(zip(grads, ref)):
        scale = float(r.abs().max()) + 1e-12
        err = float((g - r).abs().max())
        assert err <= 2e-5 * scale + 1e-7, f"{what}: parameter {i} differs by {err:.3g} (scale {scale:.3g})"


VOWELS_REWARD = """
def vowels(prompt, response, ground_truth, extra):
    return sum(ch in "aeiou" for ch in response) / max(len(response), 1)
"""
"""A reward a tiny random model learns within ten GRPO steps (more vowels), for end-to-end engine tests."""


def response_logit_grads(model, result, pad_token_id: int):
    """The gradient of a random-advantage actor loss (KL and entropy on) on ``model``'s logits at each response
    position of ``result``'s samples: (batch, grad [B, R, V], tokens the loss normaliser counted). The proof that
    tokens with response_mask 0 (environment or template tokens) get exactly zero gradient."""
    batch = scored_batch(Scored(result, torch.ones(len(result))), [], pad_token_id, None, True)
    mask = batch.response_mask
    batch.old_log_probs = batch.ref_log_probs = batch.rollout_log_probs
    batch.advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    captured = {}

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = model.lm_head.register_forward_hook(keep_logits)
    cfg = ActorConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    tokens = float(mask.sum())
    loss_fn = actor_loss_fn(model, cfg, temperature=1.0)
    loss, _ = loss_fn(batch, LossNormalizer(tokens, float((mask.sum(-1) > 0).sum()), float(mask.shape[1])))
    loss.backward()
    handle.remove()
    width_p = batch.input_ids.shape[1] - mask.shape[1]
    grad = captured["logits"].grad
    if grad.dim() == 3:  # [B, T, V]: keep the rows that predict response tokens
        grad = grad[:, width_p - 1 : -1]
    return (
        batch,
        grad.reshape(*mask.shape, -1),
        tokens,
    )  # the policy forward may narrow the head to the response
