"""verl's key names translate to posttrain's: the override lists of verl's GSM8K example scripts (copied here as
data) map key by key or fail with an error naming the key; nothing is dropped without a word."""

from pathlib import Path

import pytest
import yaml

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config, flatten, is_key, parse_overrides
from posttrain.config.verl_keys import RULES, find_rule, translate_verl_keys

# verl's examples/grpo_trainer GSM8K GRPO script (Qwen2-7B-Instruct), its override list as data.
VERL_GRPO = """
algorithm.adv_estimator=grpo
data.train_files=train.parquet
data.val_files=test.parquet
data.train_batch_size=1024
data.max_prompt_length=512
data.max_response_length=1024
data.filter_overlong_prompts=True
data.truncation=error
actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6
actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False
trainer.critic_warmup=0
trainer.logger=['console','wandb']
trainer.project_name=verl_grpo_example_gsm8k
trainer.experiment_name=qwen2_7b_function_rm
trainer.n_gpus_per_node=8
trainer.nnodes=1
trainer.save_freq=20
trainer.test_freq=5
trainer.total_epochs=15
""".split()

# The same run written by hand with posttrain's names.
OURS_GRPO = """
algorithm.adv_estimator=grpo
data.train_files=train.parquet
data.val_files=test.parquet
data.train_batch_size=1024
data.max_prompt_length=512
data.max_response_length=1024
data.overlong_prompts=filter
model.path=Qwen/Qwen2-7B-Instruct
actor.optim.lr=1e-6
model.use_remove_padding=True
actor.ppo_mini_batch_size=256
actor.ppo_micro_batch_size_per_gpu=16
actor.use_kl_loss=True
actor.kl_loss_coef=0.001
actor.kl_loss_type=low_var_kl
actor.entropy_coeff=0
model.enable_gradient_checkpointing=True
actor.fsdp_config.param_offload=False
actor.fsdp_config.optimizer_offload=False
actor.log_prob_micro_batch_size_per_gpu=16
rollout.tensor_model_parallel_size=2
rollout.name=vllm
rollout.gpu_memory_utilization=0.6
rollout.n=5
ref.log_prob_micro_batch_size_per_gpu=16
ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False
critic.warmup_steps=0
trainer.loggers=['console','wandb']
trainer.save_freq=20
trainer.test_freq=5
""".split()

# verl's examples/ppo_trainer GSM8K PPO script (deepseek-llm-7b-chat, GAE with a critic), as data.
VERL_PPO = """
algorithm.adv_estimator=gae
data.train_files=train.parquet
data.val_files=test.parquet
data.train_batch_size=1024
data.max_prompt_length=512
data.max_response_length=512
data.filter_overlong_prompts=True
data.truncation=error
actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.actor.use_kl_loss=False
actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.4
critic.optim.lr=1e-5
critic.model.use_remove_padding=False
critic.model.path=deepseek-ai/deepseek-llm-7b-chat
critic.model.enable_gradient_checkpointing=True
critic.ppo_micro_batch_size_per_gpu=32
critic.model.fsdp_config.param_offload=False
critic.model.fsdp_config.optimizer_offload=False
algorithm.use_kl_in_reward=False
trainer.critic_warmup=0
trainer.logger=['console']
trainer.project_name=verl_example_gsm8k
trainer.experiment_name=deepseek_llm_7b_function_rm
trainer.n_gpus_per_node=8
trainer.nnodes=1
trainer.total_training_steps=2
trainer.use_legacy_worker_impl=False
trainer.total_epochs=15
""".split()

OURS_PPO = """
algorithm.adv_estimator=gae
data.train_files=train.parquet
data.val_files=test.parquet
data.train_batch_size=1024
data.max_prompt_length=512
data.max_response_length=512
data.overlong_prompts=filter
model.path=deepseek-ai/deepseek-llm-7b-chat
actor.optim.lr=1e-6
model.use_remove_padding=True
actor.ppo_mini_batch_size=256
actor.ppo_micro_batch_size_per_gpu=16
actor.fsdp_config.param_offload=False
actor.fsdp_config.optimizer_offload=False
actor.use_kl_loss=False
model.enable_gradient_checkpointing=True
actor.log_prob_micro_batch_size_per_gpu=32
rollout.tensor_model_parallel_size=4
rollout.name=vllm
rollout.gpu_memory_utilization=0.4
critic.optim.lr=1e-5
critic.use_remove_padding=False
critic.model_path=deepseek-ai/deepseek-llm-7b-chat
critic.enable_gradient_checkpointing=True
critic.ppo_micro_batch_size_per_gpu=32
critic.fsdp_config.param_offload=False
critic.fsdp_config.optimizer_offload=False
algorithm.use_kl_in_reward=False
critic.warmup_steps=0
trainer.loggers=['console']
trainer.total_steps=2
""".split()


def accounted(overrides, caplog):
    """Every verl key of ``overrides`` either kept as a posttrain key or recorded as translated/ignored."""
    values = parse_overrides(overrides)
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain"):
        out, done = translate_verl_keys(values, is_key)
    seen = {t.verl for t in done} | {k for k in values if is_key(k) and find_rule(k) is None}
    assert seen == set(values), f"dropped without a word: {set(values) - seen}"
    return out, done, [r.getMessage() for r in caplog.records]


def test_verl_ppo_example_translates_to_the_hand_written_config(caplog):
    _, done, warned = accounted(VERL_PPO, caplog)
    assert any("trainer.n_gpus_per_node=8 is ignored" in w for w in warned)
    assert any("trainer.total_epochs=15 is ignored" in w for w in warned)
    assert {t.verl: t.ours for t in done}["critic.model.path"] == "critic.model_path"
    assert build_config(overrides=VERL_PPO) == build_config(overrides=OURS_PPO)


def test_verl_grpo_example_needs_steps_not_epochs(caplog):
    with pytest.raises(ConfigError, match=r"'trainer.total_epochs' = '15'.*trainer.total_training_steps"):
        build_config(overrides=VERL_GRPO)
    fixed = [*VERL_GRPO, "trainer.total_training_steps=100"]
    accounted(fixed, caplog)
    assert build_config(overrides=fixed) == build_config(overrides=[*OURS_GRPO, "trainer.total_steps=100"])


def test_verl_yaml_file_translates(tmp_path):
    (tmp_path / "verl.yaml").write_text(
        "actor_rollout_ref:\n  rollout:\n    n: 8\n    val_kwargs:\n      do_sample: false\n"
        "trainer:\n  save_freq: -1\n  total_training_steps: 3\n"
        "custom_reward_function:\n  path: my_reward.py\n"
    )
    cfg = build_config([tmp_path / "verl.yaml"])
    assert (cfg.rollout.n, cfg.rollout.val_greedy, cfg.trainer.save_freq) == (8, True, 0)
    assert cfg.trainer.total_steps == 3 and cfg.reward.function == "my_reward.py:compute_score"


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.actor.ppo_micro_batch_size=128", "ppo_micro_batch_size_per_gpu"),
        ("actor_rollout_ref.actor.no_such_key=1", "posttrain has no 'actor.no_such_key'"),
        ("actor_rollout_ref.actor.strategy=megatron", "FSDP2 only"),
        ("data.truncation=left", "never cuts a prompt"),
        ("actor_rollout_ref.rollout.val_kwargs.temperature=0.6", "rollout.val_greedy"),
        ("custom_reward_function.name=score", "custom_reward_function.path"),
    ],
)
def test_verl_key_without_counterpart_is_an_error_naming_it(override, message):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=message) as info:
        build_config(overrides=[override])
    assert key in str(info.value)


def test_every_mapped_target_is_a_posttrain_key():
    for rule in RULES:
        if rule.kind == "map" and not rule.ours.endswith(".*"):
            assert is_key(rule.ours), rule


def test_explain_prints_what_it_translated(capsys, tiny_model_dir):
    from posttrain.cli import main

    args = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "trainer.nnodes=1",
    ]
    assert main(["explain", *args]) == 0
    out = capsys.readouterr().out
    assert "actor_rollout_ref.rollout.n = 4  ->  rollout.n" in out
    assert "trainer.nnodes = 1  ->  ignored: posttrain's launcher" in out
    assert main(["explain", "rollout.n=4"]) == 0
    assert "verl keys translated" not in capsys.readouterr().out


DEFAULT_YAML = Path(__file__).parent / "data" / "verl_ppo_trainer.yaml"


def _default_yaml(tmp_path, **trainer):
    tree = yaml.safe_load(DEFAULT_YAML.read_text())
    tree["trainer"].update(trainer)
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_every_key_of_verls_default_yaml_maps_is_ignored_with_a_warning_or_errors(caplog):
    """Key by key: each one becomes a posttrain key, an ignored key with a one-line warning, or an error
    naming it; none passes through as an unknown key and none disappears without a word."""
    flat = flatten(yaml.safe_load(DEFAULT_YAML.read_text()))
    assert len(flat) > 180
    outcomes = {}
    for key, value in flat.items():
        caplog.clear()
        try:
            out, done = translate_verl_keys({key: value}, is_key)
        except ConfigError as exc:
            assert key in str(exc)
            outcomes[key] = "error"
            continue
        if done and not done[0].ours:
            warned = [r for r in caplog.records if r.levelname == "WARNING" and "ignored" in r.message]
            assert len(warned) == 1 or key.startswith("custom_reward_function."), key
            outcomes[key] = "ignored"
        else:
            assert out and all(is_key(k) for k in out), (key, out)
            outcomes[key] = "mapped"
    assert outcomes["trainer.total_epochs"] == "error"  # alone, it cannot say how many steps
    assert list(outcomes.values()).count("error") == 1
    assert outcomes["actor_rollout_ref.rollout.n"] == outcomes["trainer.save_freq"] == "mapped"
    assert (
        outcomes["trainer.n_gpus_per_node"]
        == outcomes["actor_rollout_ref.actor.ppo_micro_batch_size"]
        == "ignored"
    )


def test_verls_default_yaml_with_a_step_count_builds_posttrains_config(tmp_path):
    cfg = build_config([_default_yaml(tmp_path, total_training_steps=100)])
    assert cfg.trainer.total_steps == 100
    assert cfg.actor.ppo_mini_batch_size == 256
    assert cfg.actor.optim.warmup_steps == 0  # verl's -1: take the ratio, which is 0
    assert cfg.rollout.load_format == "dummy" and cfg.rollout.val_greedy is True
    assert cfg.trainer.save_freq == 0 and cfg.trainer.test_freq == 0  # verl's -1: never
    assert cfg.trainer.resume == "auto" and cfg.trainer.loggers == ["console", "wandb"]
    with pytest.raises(ConfigError, match="trainer.total_epochs.*total_training_steps"):
        build_config([_default_yaml(tmp_path)])


def test_resume_mode_resume_path_takes_resume_from_path():
    over = ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpts/global_step_40"]
    assert build_config(overrides=over).trainer.resume == "/ckpts/global_step_40"
    assert build_config(overrides=["trainer.resume_mode=disable"]).trainer.resume == "disable"
    with pytest.raises(ConfigError, match="resume_path.*needs trainer.resume_from_path"):
        build_config(overrides=["trainer.resume_mode=resume_path"])


def test_verls_sandbox_fusion_url_selects_that_backend():
    cfg = build_config(overrides=["reward_model.sandbox_fusion.url=http://10.0.0.5:8080"])
    assert cfg.sandbox.backend == "sandbox_fusion"
    assert cfg.sandbox.sandbox_fusion.url == ["http://10.0.0.5:8080"]


def test_verl_multi_turn_keys_map_to_ours():
    verl = "actor_rollout_ref.rollout.multi_turn."
    cfg = build_config(
        overrides=[
            f"{verl}enable=true",
            f"{verl}max_assistant_turns=3",
            f"{verl}max_user_turns=2",
            f"{verl}max_parallel_calls=1",
            f"{verl}max_tool_response_length=64",
            f"{verl}tool_response_truncate_side=left",
            f"{verl}format=chatml",
            f"{verl}tokenization_sanity_check_mode=strict",
        ]
    )
    mt = cfg.rollout.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.max_user_turns, mt.max_parallel_calls) == (True, 3, 2, 1)
    assert (mt.max_tool_response_length, mt.tool_response_truncate_side, mt.format) == (64, "left", "hermes")
    with pytest.raises(ConfigError, match="simulated users are environments: env.path"):
        build_config(overrides=[f"{verl}interaction_config_path=users.yaml"])
    with pytest.raises(ConfigError, match="rollout.multi_turn.\\* and env.\\*"):
        build_config(overrides=[f"{verl}no_such_key=1"])
