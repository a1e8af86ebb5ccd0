"""End-to-end RL runs on a tiny local model: GRPO and PPO with a critic, resume, run directory."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models.hf import load_causal_lm
from posttrain.rl import train_command as rl
from posttrain.rl.train_command import run_training
from tests.helpers import crash_and_resume, read_metrics, small_config


def changed_params(before, module):
    return {
        n: not torch.equal(before[n], p.detach()) for n, p in module.named_parameters() if p.requires_grad
    }


def assert_finite(metrics):
    for row in metrics:
        for key, value in row.items():
            assert value is not None and value == value, f"{key} is not finite at step {row['step']}"


RUNS = {  # name -> (overrides, metric keys the run must report)
    "grpo": ([], []),
    "grpo_kl_loss": (["actor.use_kl_loss=true", "actor.entropy_coeff=0.01"], ["actor/kl_loss"]),
    "kl_in_reward": (
        [
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.adv_estimator=rloo",
        ],
        ["actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"],
    ),
    "remax": (["algorithm.adv_estimator=remax"], []),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_policy_gradient_runs_update_every_parameter(tiny_model_dir, tmp_path, name):
    extra, expected = RUNS[name]
    cfg = small_config(tiny_model_dir, tmp_path / "run", *extra)
    start = load_causal_lm(tiny_model_dir)
    run_training(cfg, quiet=True)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model")
    before = {n: p.detach() for n, p in start.named_parameters()}
    changed = changed_params(before, final)
    assert all(changed.values()), [n for n, c in changed.items() if not c]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    assert_finite(metrics)
    for key in (
        "reward/mean",
        "actor/pg_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "timing/rollout",
        "perf/tokens_per_s",
        "response_length/max",
        "finish/eos",
    ):
        assert key in metrics[-1], key
    for key in expected:
        assert key in metrics[-1], key
    for name in ("config.yaml", "plan.json", "curves.png"):
        assert (tmp_path / "run" / name).exists()


def test_ppo_with_critic_updates_actor_and_critic(tiny_model_dir, tmp_path):
    cfg = small_config(tiny_model_dir, tmp_path / "run", "algorithm.adv_estimator=gae", "algorithm.lam=0.95")
    captured = {}
    original = rl.build_components

    def capture(*args, **kwargs):
        c = original(*args, **kwargs)
        captured["actor"] = {n: p.detach().clone() for n, p in c.actor.module.named_parameters()}
        captured["critic"] = {n: p.detach().clone() for n, p in c.critic.module.named_parameters()}
        captured["c"] = c
        return c

    rl.build_components = capture
    try:
        run_training(cfg, quiet=True)
    finally:
        rl.build_components = original
    c = captured["c"]
    for role, module in (("actor", c.actor.module), ("critic", c.critic.module)):
        changed = changed_params(captured[role], module)
        assert all(changed.values()), (role, [n for n, ch in changed.items() if not ch])
    metrics = read_metrics(tmp_path / "run")
    assert_finite(metrics)
    assert {"critic/loss", "critic/vf_clipfrac", "critic/grad_norm"} <= set(metrics[-1])


def test_resume_continues_exactly(tiny_model_dir, tmp_path, monkeypatch):
    keys = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")
    crash_and_resume(tiny_model_dir, tmp_path, monkeypatch, (), keys)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final_model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "final_model").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)


def test_gsm8k_files_and_reward_model(tiny_model_dir, tmp_path):
    """GSM8K-format files with the numeric verifier, plus a sequence-classification reward model."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from posttrain.models.hf import load_tokenizer

    rows = [
        {
            "question": f"Tom has {i} apples and buys 2 more. How many?",
            "answer": f"{i}+2={i + 2}\n#### {i + 2}",
        }
        for i in range(8)
    ]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    tok = load_tokenizer(tiny_model_dir)
    rm_dir = tmp_path / "rm"
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        "data.task=gsm8k",
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        "reward.function=",
        "data.max_prompt_length=128",
        "trainer.total_steps=1",
        "trainer.test_freq=1",
        "reward.model.enable=true",
        f"reward.model.path={rm_dir}",
    )
    final = run_training(cfg, quiet=True)
    assert "reward/model_score_mean" in final and "val/accuracy" in final
    assert_finite(read_metrics(tmp_path / "run"))


def test_rerunning_a_finished_run_says_so(tiny_model_dir, tmp_path):
    cfg = small_config(tiny_model_dir, tmp_path / "run", "trainer.total_steps=1")
    run_training(cfg, quiet=True)
    with pytest.raises(ValueError, match="already holds a finished run"):
        run_training(cfg, quiet=True)
    more = small_config(tiny_model_dir, tmp_path / "run", "trainer.total_steps=2")
    run_training(more, quiet=True)
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]
