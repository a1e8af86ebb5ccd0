"""verl's configuration key names, translated to posttrain's.

A YAML file or override written with verl's names (``actor_rollout_ref.actor.ppo_mini_batch_size=256``,
``actor_rollout_ref.rollout.n=5``, ``reward_model.enable=true``, ``trainer.total_training_steps=100``) is
translated before the schema sees it. Every verl key ends one of three ways, never silently:

- **mapped** to a posttrain key (the value converted where the two differ, e.g. verl's ``save_freq=-1``);
- **ignored** with a one-line warning, where ignoring changes nothing about the run (``trainer.nnodes``: the
  launcher decides; ``trainer.project_name``: posttrain names runs by ``trainer.run_dir``);
- a :class:`ConfigError` that names the key and says why there is no counterpart and what to do.

Keys that are already posttrain keys pass through unchanged (most of ``algorithm.*`` and ``data.*`` share
verl's names). The rules are data (:data:`RULES`); docs/migrating-from-verl.md prints them as a table.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.config.errors import ConfigError

log = logging.getLogger("posttrain")

MAP, IGNORE, ERROR = "map", "ignore", "error"
_TRUE = {"true", "1", "yes", "on"}


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in _TRUE)


def _freq(value: Any) -> Any:
    """verl's ``-1`` (never) is posttrain's ``0``."""
    return 0 if str(value).strip() == "-1" else value


def _warmup(value: Any) -> Any:
    """verl's negative warm-up steps (use the ratio instead, 0 by default) are no warm-up."""
    try:
        return 0 if float(value) < 0 else value
    except (TypeError, ValueError):
        return value


def _overlong(value: Any) -> str:
    return "filter" if _truthy(value) else "error"


def _not(value: Any) -> bool:
    return not _truthy(value)


def _is_null(value: Any) -> bool:
    """verl's ``null`` (YAML null, or the override text): the key sets nothing."""
    return value is None or (isinstance(value, str) and value.strip() in ("null", "None", "~"))


def _url_list(value: Any) -> Any:
    """verl's one sandbox URL (a string) is a one-element list of posttrain's."""
    return [value] if isinstance(value, str) and not value.startswith("[") else value


def _engine(value: Any) -> Any:
    """verl's SGLang rollout is posttrain's vLLM engine when vllm is installed, else its native engine; verl's
    hf rollout is the native engine (both generate with the Hugging Face model)."""
    name = str(value).strip()
    if name in ("sglang", "sglang_async"):
        return "vllm" if importlib.util.find_spec("vllm") is not None else "native"
    return "native" if name == "hf" else value


@dataclass(frozen=True)
class Rule:
    """How one verl key (or, ending in ``.*``, every key under a prefix) becomes posttrain's.

    Attributes:
        verl: the verl key, or a prefix ``section.*``.
        kind: ``map``, ``ignore`` or ``error``.
        ours: the posttrain key (or prefix) for ``map``.
        why: one line for warnings, errors and the docs table.
        convert: value conversion for ``map`` (None: unchanged).
        allowed: for ``ignore``/``error``: values with which the key is harmless and ignored; any other value
            is an error (e.g. ``data.truncation=error`` is posttrain's behaviour, ``left`` is not supported).
        warns: for ``map``: a value that the conversion changes is said in a warning line (a substitute).
    """

    verl: str
    kind: str
    ours: str = ""
    why: str = ""
    convert: Callable[[Any], Any] | None = None
    allowed: tuple[str, ...] = ()
    warns: bool = False


_HYDRA = (
    "Hydra's composition: posttrain reads no other files (not verl's ppo_trainer.yaml); the file's keys apply over "
    "posttrain's own defaults (posttrain explain --keys)"
)
_LAUNCHER = "posttrain's launcher (torchrun or trainer.ray_ranks) decides the processes and GPUs"
_DEPRECATED_GLOBAL = "verl's deprecated global micro batch size; give the per-GPU key ({}) instead"
_NO_EFFECT = "no effect on the run in posttrain"
_WRAP = "posttrain's FSDP2 shards each decoder layer"
_FALSE = ("False", "false", "0")

RULES: list[Rule] = [
    # --- Hydra's own keys at the top of verl's example files
    Rule("hydra.*", IGNORE, why=_HYDRA),
    Rule("defaults", IGNORE, why=_HYDRA),
    # --- actor_rollout_ref.actor
    Rule("actor_rollout_ref.actor.ppo_micro_batch_size", ERROR,
         why=_DEPRECATED_GLOBAL.format("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")),
    Rule("actor_rollout_ref.actor.grad_clip", MAP, "actor.optim.grad_clip"),
    Rule("actor_rollout_ref.actor.policy_loss.loss_mode", MAP, "actor.policy_loss"),
    Rule("actor_rollout_ref.actor.optim.lr_warmup_steps", MAP, "actor.optim.warmup_steps", convert=_warmup,
         why="verl's -1 (take the ratio) is 0"),
    Rule("actor_rollout_ref.actor.optim.warmup_style", MAP, "actor.optim.lr_schedule"),
    Rule("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", ERROR, allowed=("0", "0.0"),
         why="posttrain counts warm-up in optimizer steps: set actor.optim.warmup_steps"),
    Rule("actor_rollout_ref.actor.optim.total_training_steps", IGNORE, why="verl fills it in; posttrain too"),
    Rule("actor_rollout_ref.actor.fsdp_config.grad_offload", IGNORE, why="deprecated in verl; " + _NO_EFFECT),
    Rule("actor_rollout_ref.actor.strategy", ERROR, allowed=("fsdp", "fsdp2"),
         why="posttrain trains with FSDP2 only (no Megatron backend)"),
    Rule("actor_rollout_ref.actor.use_torch_compile", IGNORE, why="a speed switch; " + _NO_EFFECT),
    Rule("actor_rollout_ref.actor.clip_ratio", ERROR, allowed=("0.2",),
         why="verl's fallback for both clip bounds; give actor.clip_ratio_low and actor.clip_ratio_high (0.2 each "
         "by default)"),
    Rule("actor_rollout_ref.actor.fsdp_config.wrap_policy.*", IGNORE, why=_WRAP),
    Rule("actor_rollout_ref.actor.fsdp_config.offload_policy", ERROR, allowed=_FALSE,
         why="posttrain offloads with actor.fsdp_config.param_offload/optimizer_offload"),
    Rule("actor_rollout_ref.actor.checkpoint.*", IGNORE, why="posttrain always saves model, optimizer and state"),
    Rule("actor_rollout_ref.actor.*", MAP, "actor.*"),
    # --- actor_rollout_ref.rollout
    Rule("actor_rollout_ref.rollout.log_prob_micro_batch_size", ERROR,
         why=_DEPRECATED_GLOBAL.format("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")),
    Rule("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", MAP, "actor.log_prob_micro_batch_size_per_gpu"),
    Rule("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", MAP, "actor.log_prob_max_token_len_per_gpu"),
    Rule("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", IGNORE,
         why="posttrain's old-log-prob pass follows actor.use_dynamic_bsz"),
    Rule("actor_rollout_ref.rollout.val_kwargs.n", MAP, "rollout.val_n"),
    Rule("actor_rollout_ref.rollout.val_kwargs.do_sample", MAP, "rollout.val_greedy", convert=_not),
    Rule("actor_rollout_ref.rollout.val_kwargs.temperature", ERROR, allowed=("0", "0.0"),
         why="posttrain validates with rollout.temperature, or greedily (rollout.val_greedy=true)"),
    Rule("actor_rollout_ref.rollout.val_kwargs.top_k", ERROR, allowed=("-1", "0"),
         why="posttrain validates with rollout.top_k, or greedily (rollout.val_greedy=true)"),
    Rule("actor_rollout_ref.rollout.val_kwargs.top_p", ERROR, allowed=("1", "1.0"),
         why="posttrain validates with rollout.top_p, or greedily (rollout.val_greedy=true)"),
    Rule("actor_rollout_ref.rollout.val_kwargs.*", ERROR,
         why="posttrain validates with rollout.temperature/top_p/top_k, or greedily (rollout.val_greedy=true)"),
    Rule("actor_rollout_ref.rollout.load_format", MAP, "rollout.load_format",
         convert=lambda v: "dummy" if str(v).startswith("dummy") else v,
         why="verl's dummy_dtensor/dummy_hf are dummy: the trainer pushes the weights"),
    Rule("actor_rollout_ref.rollout.name", MAP, "rollout.name", convert=_engine, warns=True,
         why="posttrain has no SGLang engine: sglang runs on vllm when it is installed, else on the native engine "
         "(the multi-turn loop is posttrain's own over either; the engine changes speed, not what is trained); "
         "hf is the native engine"),
    Rule("actor_rollout_ref.rollout.mode", IGNORE, why="posttrain's engine has one mode"),
    Rule("actor_rollout_ref.rollout.dtype", IGNORE, why="the rollout uses model.dtype"),
    Rule("actor_rollout_ref.rollout.prompt_length", IGNORE, why="taken from data.max_prompt_length"),
    Rule("actor_rollout_ref.rollout.response_length", IGNORE, why="taken from data.max_response_length"),
    Rule("actor_rollout_ref.rollout.do_sample", ERROR, allowed=("True", "true"),
         why="posttrain's rollout samples; for greedy set rollout.temperature=0"),
    Rule("actor_rollout_ref.rollout.ignore_eos", ERROR, allowed=_FALSE, why="posttrain stops a response at EOS"),
    Rule("actor_rollout_ref.rollout.use_fire_sampling", ERROR, allowed=_FALSE, why="posttrain has no FIRE sampling"),
    Rule("actor_rollout_ref.rollout.chat_scheduler", ERROR, why="posttrain's agent loop is rollout.multi_turn.* and env.* (docs/agents.md)"),
    Rule("actor_rollout_ref.rollout.engine_kwargs.*", ERROR,
         why="posttrain passes no free-form engine arguments; see rollout.* for the ones it has"),
    *[Rule(f"actor_rollout_ref.rollout.multi_turn.{k}", MAP, f"rollout.multi_turn.{k}", why=why) for k, why in (
        ("enable", ""),
        ("max_assistant_turns", "verl's null (no limit) keeps posttrain's default"),
        ("max_user_turns", "verl's null (no limit) keeps posttrain's default"),
        ("max_parallel_calls", ""),
        ("max_tool_response_length", ""),
        ("tool_response_truncate_side", ""),
        ("tool_config_path", "verl's tool YAML reads (class_name naming a function; docs/agents.md)"),
    )],
    Rule("actor_rollout_ref.rollout.multi_turn.max_turns", MAP, "rollout.multi_turn.max_assistant_turns",
         why="verl's older name of max_assistant_turns"),
    Rule("actor_rollout_ref.rollout.multi_turn.format", MAP, "rollout.multi_turn.format",
         convert=lambda v: "hermes" if str(v).strip() in ("chatml", "qwen") else v,
         why="verl's qwen (and its older name chatml) is the Hermes format Qwen's chat template writes"),
    Rule("actor_rollout_ref.rollout.multi_turn.interaction_config_path", ERROR, allowed=("None", "null"),
         why="posttrain's simulated users are environments: env.path (docs/agents.md)"),
    Rule("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", ERROR, allowed=_FALSE,
         why="posttrain renders each new message with the chat template and keeps the tokens it sampled"),
    Rule("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", IGNORE,
         why="posttrain keeps the sampled ids and renders only new messages; a template that rewrites history is "
         "an error (TemplateDriftError)"),
    Rule("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", ERROR, allowed=("None", "null"),
         why="each trajectory is rolled out once; rollout.n sets the samples per prompt"),
    Rule("actor_rollout_ref.rollout.multi_turn.*", ERROR,
         why="no counterpart; posttrain's multi-turn keys are rollout.multi_turn.* and env.* (docs/agents.md)"),
    Rule("actor_rollout_ref.rollout.*", MAP, "rollout.*"),
    # --- actor_rollout_ref.ref and .model
    Rule("actor_rollout_ref.ref.log_prob_micro_batch_size", ERROR,
         why=_DEPRECATED_GLOBAL.format("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")),
    Rule("actor_rollout_ref.ref.strategy", ERROR, allowed=("fsdp", "fsdp2"), why="posttrain runs FSDP2 only"),
    Rule("actor_rollout_ref.ref.use_torch_compile", IGNORE, why="a speed switch; " + _NO_EFFECT),
    Rule("actor_rollout_ref.ref.fsdp_config.wrap_policy.*", IGNORE, why=_WRAP),
    Rule("actor_rollout_ref.ref.*", MAP, "ref.*"),
    Rule("actor_rollout_ref.model.use_shm", IGNORE, why="a loading speed switch; " + _NO_EFFECT),
    Rule("actor_rollout_ref.model.use_fused_kernels", IGNORE, why="a speed switch; " + _NO_EFFECT),
    Rule("actor_rollout_ref.model.external_lib", ERROR,
         why="posttrain loads models with transformers' AutoModelForCausalLM; import the library yourself"),
    Rule("actor_rollout_ref.model.override_config", ERROR, allowed=("{}",),
         why="posttrain loads the model's own config; edit config.json of a copy to change it"),
    Rule("actor_rollout_ref.model.return_last_hidden_state", ERROR, allowed=_FALSE, why=_NO_EFFECT),
    Rule("actor_rollout_ref.model.use_fused_loss", IGNORE, why="a speed switch; " + _NO_EFFECT),
    Rule("actor_rollout_ref.model.*", MAP, "model.*"),
    Rule("actor_rollout_ref.hybrid_engine", ERROR, allowed=("True", "true"),
         why="posttrain's trainer and rollout always share the weights (hybrid)"),
    # --- critic
    Rule("critic.ppo_micro_batch_size", ERROR, why=_DEPRECATED_GLOBAL.format("critic.ppo_micro_batch_size_per_gpu")),
    Rule("critic.grad_clip", MAP, "critic.optim.grad_clip"),
    Rule("critic.strategy", ERROR, allowed=("fsdp", "fsdp2"), why="posttrain trains with FSDP2 only"),
    Rule("critic.optim.lr_warmup_steps", MAP, "critic.optim.warmup_steps", convert=_warmup,
         why="verl's -1 (take the ratio) is 0"),
    Rule("critic.optim.warmup_style", MAP, "critic.optim.lr_schedule"),
    Rule("critic.optim.lr_warmup_steps_ratio", ERROR, allowed=("0", "0.0"),
         why="posttrain counts warm-up in optimizer steps: set critic.optim.warmup_steps"),
    Rule("critic.forward_micro_batch_size", ERROR,
         why=_DEPRECATED_GLOBAL.format("critic.forward_micro_batch_size_per_gpu")),
    Rule("critic.rollout_n", IGNORE, why="taken from rollout.n"),
    Rule("critic.optim.total_training_steps", IGNORE, why="verl fills it in; posttrain too"),
    Rule("critic.model.path", MAP, "critic.model_path"),
    Rule("critic.model.override_config", ERROR, allowed=("{}",), why="posttrain loads the model's own config"),
    Rule("critic.model.external_lib", ERROR, why="posttrain loads models with transformers' Auto classes"),
    Rule("critic.model.fsdp_config.wrap_policy.*", IGNORE, why=_WRAP),
    Rule("critic.model.fsdp_config.offload_policy", ERROR, allowed=_FALSE,
         why="posttrain offloads with critic.fsdp_config.param_offload/optimizer_offload"),
    Rule("critic.model.tokenizer_path", IGNORE, why="the critic shares the policy's tokenizer"),
    Rule("critic.model.*", MAP, "critic.*"),
    Rule("critic.checkpoint.*", IGNORE, why="posttrain always saves model, optimizer and state"),
    # --- reward
    Rule("reward_model.enable", MAP, "reward.model.enable"),
    Rule("reward_model.model.path", MAP, "reward.model.path"),
    Rule("reward_model.model.input_tokenizer", IGNORE,
         why="posttrain re-tokenizes the chat for the reward model with its own tokenizer"),
    Rule("reward_model.model.external_lib", ERROR, why="posttrain loads models with transformers' Auto classes"),
    Rule("reward_model.model.fsdp_config.*", IGNORE, why="posttrain shards the reward model as it shards the policy"),
    Rule("reward_model.model.*", MAP, "reward.model.*"),
    Rule("reward_model.micro_batch_size", ERROR,
         why=_DEPRECATED_GLOBAL.format("reward_model.micro_batch_size_per_gpu")),
    Rule("reward_model.max_length", ERROR, why="the reward model reads data.max_prompt_length + "
         "data.max_response_length tokens"),
    Rule("reward_model.ulysses_sequence_parallel_size", ERROR, allowed=("1",),
         why="posttrain runs the reward model without sequence parallelism"),
    Rule("reward_model.launch_reward_fn_async", IGNORE,
         why="posttrain scores rewards in worker processes (reward.num_workers) on its own schedule"),
    Rule("reward_model.sandbox_fusion.url", MAP, "sandbox.sandbox_fusion.url", convert=_url_list,
         why="and sandbox.backend=sandbox_fusion"),
    Rule("reward_model.sandbox_fusion.max_concurrent", MAP, "sandbox.max_concurrent"),
    Rule("reward_model.sandbox_fusion.memory_limit_mb", MAP, "sandbox.memory_limit_mb"),
    Rule("reward_model.strategy", ERROR, allowed=("fsdp", "fsdp2"), why="posttrain runs reward models with FSDP2"),
    Rule("reward_model.reward_manager", ERROR, allowed=("naive", "dapo"),
         why="posttrain has one reward manager (verl's naive; DAPO's overlong shaping is reward.overlong_buffer.*)"),
    Rule("reward_model.overlong_buffer.*", MAP, "reward.overlong_buffer.*"),
    Rule("reward_model.reward_kwargs.overlong_buffer_cfg.*", MAP, "reward.overlong_buffer.*"),
    Rule("reward_model.reward_kwargs.max_resp_len", IGNORE, why="taken from data.max_response_length"),
    Rule("reward_model.*", MAP, "reward.model.*"),
    Rule("custom_reward_function.path", MAP, "reward.function",
         why="with custom_reward_function.name (default compute_score) it becomes reward.function=path:name"),
    Rule("custom_reward_function.name", MAP, "reward.function", why="see custom_reward_function.path"),
    # --- data
    Rule("data.filter_overlong_prompts", MAP, "data.overlong_prompts", convert=_overlong),
    Rule("data.truncation", ERROR, allowed=("error",),
         why="posttrain never cuts a prompt: overlong prompts are dropped and counted or an error "
         "(data.overlong_prompts)"),
    Rule("data.reward_fn_key", ERROR, allowed=("data_source",),
         why="posttrain dispatches built-in scorers by the data_source field only"),
    Rule("data.return_raw_chat", IGNORE, why=_NO_EFFECT),
    Rule("data.return_raw_input_ids", IGNORE, why=_NO_EFFECT),
    Rule("data.return_full_prompt", IGNORE, why=_NO_EFFECT),
    Rule("data.shuffle", IGNORE, why="posttrain always shuffles the training data, seeded by trainer.seed"),
    Rule("data.validation_shuffle", IGNORE, why=_NO_EFFECT),
    Rule("data.dataloader_num_workers", IGNORE, why=_NO_EFFECT),
    Rule("data.filter_overlong_prompts_workers", IGNORE, why=_NO_EFFECT),
    Rule("data.tokenizer", ERROR, allowed=("None", "null", "none", ""),
         why="posttrain uses the model's own tokenizer (model.path)"),
    Rule("data.use_shm", IGNORE, why=_NO_EFFECT),
    Rule("data.trust_remote_code", IGNORE, why=_NO_EFFECT),
    Rule("data.image_key", IGNORE, why="posttrain trains text models only"),
    Rule("data.video_key", IGNORE, why="posttrain trains text models only"),
    Rule("data.custom_cls.*", ERROR, why="posttrain reads parquet, JSON and JSONL rows itself; convert the data "
         "to one of those"),
    # --- trainer
    Rule("trainer.total_training_steps", MAP, "trainer.total_steps"),
    Rule("trainer.total_epochs", ERROR,
         why="posttrain counts steps, not epochs: set trainer.total_training_steps (or trainer.total_steps) "
         "to epochs x training rows / data.train_batch_size"),
    Rule("trainer.logger", MAP, "trainer.loggers"),
    Rule("trainer.save_freq", MAP, "trainer.save_freq", convert=_freq, why="verl's -1 (never) is 0"),
    Rule("trainer.test_freq", MAP, "trainer.test_freq", convert=_freq, why="verl's -1 (never) is 0"),
    Rule("trainer.critic_warmup", MAP, "critic.warmup_steps"),
    Rule("trainer.default_local_dir", MAP, "trainer.run_dir"),
    Rule("trainer.resume_from_path", MAP, "trainer.resume"),
    Rule("trainer.resume_mode", MAP, "trainer.resume",
         why="auto and disable are posttrain's too; resume_path takes trainer.resume_from_path"),
    Rule("trainer.max_actor_ckpt_to_keep", MAP, "trainer.max_ckpt_to_keep"),
    Rule("trainer.max_critic_ckpt_to_keep", IGNORE, why="actor and critic checkpoints are kept together"),
    Rule("trainer.n_gpus_per_node", IGNORE, why=_LAUNCHER),
    Rule("trainer.nnodes", IGNORE, why=_LAUNCHER),
    Rule("trainer.project_name", IGNORE, why="posttrain names a run by trainer.run_dir"),
    Rule("trainer.experiment_name", IGNORE, why="posttrain names a run by trainer.run_dir"),
    Rule("trainer.val_before_train", IGNORE, allowed=("True", "true"),
         why="posttrain validates before training whenever trainer.test_freq > 0"),
    Rule("trainer.use_legacy_worker_impl", IGNORE, why=_NO_EFFECT),
    Rule("trainer.balance_batch", IGNORE, why="posttrain balances micro-batches by token count itself"),
    Rule("trainer.log_val_generations", IGNORE, why="posttrain writes validation samples to the run directory"),
    Rule("trainer.default_hdfs_dir", IGNORE, why=_NO_EFFECT),
    Rule("trainer.del_local_ckpt_after_load", IGNORE, why=_NO_EFFECT),
    Rule("trainer.ray_wait_register_center_timeout", IGNORE, why=_NO_EFFECT),
    Rule("trainer.rollout_data_dir", IGNORE, why="posttrain writes rollout samples to the run directory"),
    Rule("trainer.validation_data_dir", IGNORE, why="posttrain writes validation samples to the run directory"),
    Rule("ray_init.*", IGNORE, why="posttrain starts Ray itself when trainer.ray_ranks is set"),
]  # fmt: skip
"""Checked in order: exact keys before the prefix that holds them."""


@dataclass(frozen=True)
class Translation:
    """What became of one verl key: ``ours`` is empty when it was ignored."""

    verl: str
    ours: str
    value: Any
    note: str = ""


#: What the last config built in this process translated (``posttrain explain`` prints it); reset by
#: :func:`posttrain.config.load.build_config`.
LAST_TRANSLATED: list[Translation] = []


def translated_lines(items: list[Translation]) -> list[str]:
    """One line per translated verl key, for ``posttrain explain``."""
    return [f"  {t.verl} = {t.value}  ->  {t.ours or 'ignored: ' + t.note}" for t in items]


def find_rule(key: str) -> Rule | None:
    """The first rule for ``key``: an exact one, else the longest prefix written before it."""
    for rule in RULES:
        if rule.verl == key or (rule.verl.endswith(".*") and key.startswith(rule.verl[:-1])):
            return rule
    return None


def translate_verl_keys(
    values: dict[str, Any], is_ours: Callable[[str], bool]
) -> tuple[dict[str, Any], list[Translation]]:
    """``values`` (dotted key -> value, from one YAML file or one override list) with verl's keys replaced
    by posttrain's, and what was translated. ``is_ours(key)`` says whether a key is a posttrain key; those
    pass through unless a rule says verl means something else by it (``trainer.save_freq=-1``)."""
    out: dict[str, Any] = {}
    done: list[Translation] = []
    reward_path = reward_name = None
    verl_source = any(find_rule(k) is not None and not is_ours(k) for k in values)
    hydra = [k for k in values if find_rule(k) is not None and find_rule(k).why == _HYDRA]  # type: ignore[union-attr]
    if hydra:  # the file's composition header: one line for all of it
        log.warning("verl keys %s are ignored: %s", ", ".join(hydra), _HYDRA)
        done.extend(Translation(k, "", values[k], _HYDRA) for k in hydra)
    for key, value in values.items():
        if key in hydra:
            continue
        rule = find_rule(key)
        # in a source written with verl's names, null sets nothing: posttrain's default (or another key) decides
        null = verl_source and _is_null(value) and not key.startswith("custom_reward_function.")
        if not null and (rule is None or (is_ours(key) and rule.convert is None)):
            out[key] = value
            continue
        if not null and rule.verl.startswith("custom_reward_function."):  # type: ignore[union-attr]
            reward_path, reward_name = (value, reward_name) if key.endswith(".path") else (reward_path, value)
            continue
        if null:
            log.warning("verl key %s=null is ignored: null sets nothing", key)
            done.append(Translation(key, "", value, "null sets nothing"))
            continue
        if key == "trainer.resume_from_path" and "trainer.resume_mode" in values:
            done.append(Translation(key, "", value, "read with trainer.resume_mode"))
            continue
        if key == "trainer.resume_mode":
            value = _resume(value, values.get("trainer.resume_from_path"))
        item = _apply(rule, key, value, values, is_ours)
        if item.ours:
            out[item.ours] = _convert(rule, value)
            if rule.warns and str(out[item.ours]) != str(value):
                log.warning("verl key %s=%s -> %s=%s: %s", key, value, item.ours, out[item.ours], rule.why)
        done.append(item)
    if not _is_null(reward_path) or not (_is_null(reward_name) or reward_name == "compute_score"):
        done.append(_reward_function(reward_path, reward_name, out))
    elif any(k.startswith("custom_reward_function.") for k in values):
        done.append(Translation("custom_reward_function.path/name", "", reward_path, "null sets nothing"))
    if out.get("sandbox.sandbox_fusion.url") and "sandbox.backend" not in out:
        out["sandbox.backend"] = "sandbox_fusion"
    LAST_TRANSLATED.extend(done)
    for item in done:
        log.info("verl key %s=%s -> %s", item.verl, item.value, item.ours or f"ignored ({item.note})")
    return out, done


def _apply(
    rule: Rule, key: str, value: Any, values: dict[str, Any], is_ours: Callable[[str], bool]
) -> Translation:
    harmless = str(value).strip() in rule.allowed
    if rule.kind == MAP:
        ours = rule.ours[:-1] + key[len(rule.verl) - 1 :] if rule.verl.endswith(".*") else rule.ours
        if not is_ours(ours):
            raise ConfigError(
                f"verl key '{key}' has no posttrain counterpart: posttrain has no '{ours}'. Remove it, or see "
                "docs/migrating-from-verl.md for what posttrain has instead"
            )
        return Translation(key, ours, value, rule.why)
    if rule.kind == IGNORE and (harmless or not rule.allowed):
        log.warning("verl key %s=%s is ignored: %s", key, value, rule.why)
        return Translation(key, "", value, rule.why)
    if rule.kind == ERROR and harmless:
        log.warning("verl key %s=%s is ignored: it is posttrain's behaviour too", key, value)
        return Translation(key, "", value, f"{value} is posttrain's behaviour too")
    if key == "trainer.total_epochs" and not _is_null(values.get("trainer.total_training_steps")):
        log.warning("verl key %s=%s is ignored: trainer.total_training_steps decides", key, value)
        return Translation(key, "", value, "trainer.total_training_steps decides")
    shown = f" (accepted: {', '.join(rule.allowed)})" if rule.allowed else ""
    raise ConfigError(f"verl key '{key}' = {value!r} has no posttrain counterpart{shown}: {rule.why}")


def _resume(mode: Any, path: Any) -> Any:
    """verl's ``resume_mode=resume_path`` resumes from ``resume_from_path``; auto and disable are ours too."""
    if str(mode).strip() != "resume_path":
        return mode
    if _is_null(path) or not str(path).strip():
        raise ConfigError(
            "verl key 'trainer.resume_mode' = 'resume_path' needs trainer.resume_from_path (the checkpoint "
            "directory); or give posttrain's trainer.resume=path/to/checkpoint"
        )
    return path


def _convert(rule: Rule, value: Any) -> Any:
    return rule.convert(value) if rule.convert else value


def _reward_function(path: Any, name: Any, out: dict[str, Any]) -> Translation:
    if not path:
        raise ConfigError(
            f"verl key 'custom_reward_function.name' = {name!r} needs custom_reward_function.path (the .py file); "
            "or give posttrain's reward.function=path/to/file.py:function_name"
        )
    out["reward.function"] = f"{path}:{name or 'compute_score'}"
    return Translation("custom_reward_function.path/name", "reward.function", out["reward.function"])


def translation_table() -> list[tuple[str, str, str]]:
    """``(verl key, posttrain key or what happens, note)`` for every rule, for the docs."""
    rows = []
    for rule in RULES:
        if rule.kind == MAP:
            target = f"`{rule.ours}`"
        elif rule.kind == IGNORE:
            target = "ignored, with a warning" + (
                f" (when {', '.join(rule.allowed)})" if rule.allowed else ""
            )
        else:
            target = "error" + (f" (accepted: {', '.join(rule.allowed)})" if rule.allowed else "")
        rows.append((f"`{rule.verl}`", target, rule.why))
    return rows


def translation_markdown() -> str:
    """The rules as a Markdown table (docs/migrating-from-verl.md holds this text)."""
    lines = ["| verl key | posttrain | note |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in translation_table()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # regenerates the table in docs/migrating-from-verl.md
    print(translation_markdown(), end="")
