"""Value rules the per-field bounds (``knob(min=, max=, choices=)``) cannot express: finiteness, list shapes,
forbidden single values, names from a registry, and rules spanning several keys.

:func:`check_value` runs on every key as it is applied; :func:`check_config` runs once on the finished
config. Both raise ConfigError naming the key, its value, the rule and a fix, before any model loads.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from posttrain.algorithms.names import GROUP_ESTIMATORS
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig, TrainerConfig
from posttrain.config.schema.harness import harness_enabled
from posttrain.config.schema.names import BUILTIN_TASKS, SCHEMAS_HIDDEN_BY_DEFAULT, TASK_ENVIRONMENTS

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# Estimators whose advantage is a sample's reward relative to the other samples of its prompt's group.


def check_value(key: str, value: Any) -> None:
    """Rules on one key's (already typed) value."""
    leaf = key.rsplit(".", 1)[-1]
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"config key '{key}' = {value!r} must be a finite number; NaN or infinity would poison every "
            "value computed from it (give a plain number, e.g. the default from `posttrain explain --keys`)"
        )
    if leaf == "betas" and key.endswith("optim.betas"):
        _check_betas(key, value)
    elif key.endswith("optim.eps") and value <= 0:
        raise ConfigError(f"config key '{key}' = {value!r} must be > 0 (it guards a division; e.g. 1e-8)")
    elif key == "rollout.top_k" and value == 0:
        raise ConfigError(
            "config key 'rollout.top_k' = 0 is not valid: it would keep no token. Use -1 to disable top-k "
            "sampling, or k >= 1 to sample among the k most likely tokens"
        )
    elif key == "data.task" and value not in BUILTIN_TASKS and not value.startswith("reasoning_gym:"):
        raise ConfigError(
            f"config key 'data.task' = {value!r} is not one of {', '.join(map(repr, BUILTIN_TASKS))} or "
            "'reasoning_gym:<name>' "
            "(e.g. data.task=reasoning_gym:basic_arithmetic)"
        )
    elif key == "trainer.loggers":
        unknown = [name for name in value if name not in LOGGERS]
        if unknown:
            raise ConfigError(
                f"config key 'trainer.loggers' has unknown name(s) {unknown}; valid loggers are "
                f"{', '.join(LOGGERS)} (e.g. trainer.loggers=[console,jsonl])"
            )


def resolve_task_environment(cfg: PostTrainConfig, explicit: set[str]) -> None:
    """A multi-turn task (data.task) implies rollout.multi_turn.enable=true and, when env.path is empty, plays in
    its environment (unless a harness plays it); ``explicit`` are the keys the user set (an explicit enable=false
    is an error)."""
    environment = TASK_ENVIRONMENTS.get(cfg.data.task)
    mt = cfg.rollout.multi_turn
    if environment is None or harness_enabled(cfg.harness):
        return  # with a harness the task gives its rows and its reward; the harness plays them, not the environment
    if not mt.enable and "rollout.multi_turn.enable" in explicit:
        raise ConfigError(
            f"rollout.multi_turn.enable=false, but data.task={cfg.data.task} is a multi-turn task (played in the "
            f"{environment!r} environment): it cannot be rolled out in one turn; drop "
            "rollout.multi_turn.enable=false (the task turns it on), or pick a single-turn task (e.g. arithmetic)"
        )
    mt.enable = True
    if not cfg.env.path:
        cfg.env.path = environment


def resolve_render_tools(cfg: PostTrainConfig, explicit: set[str]) -> None:
    """A built-in environment of :data:`SCHEMAS_HIDDEN_BY_DEFAULT` leaves its schemas out of the prompt unless
    rollout.multi_turn.render_tools is among ``explicit``, the keys the user set (once, where the config is built:
    a config changed later keeps what was resolved)."""
    if cfg.env.path in SCHEMAS_HIDDEN_BY_DEFAULT and "rollout.multi_turn.render_tools" not in explicit:
        cfg.rollout.multi_turn.render_tools = False


def _check_betas(key: str, betas: list[float]) -> None:
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError(
            f"config key '{key}' = {betas!r} must be exactly two numbers, each in [0, 1) (AdamW's decay "
            f"rates of the first and second moments), e.g. {key}=[0.9,0.999]"
        )


def check_config(cfg: PostTrainConfig) -> None:
    """Rules spanning several keys."""
    r, estimator = cfg.rollout, cfg.algorithm.adv_estimator
    if r.temperature == 0 and r.n > 1 and estimator in GROUP_ESTIMATORS:
        raise ConfigError(
            f"rollout.temperature=0 decodes greedily, so the rollout.n={r.n} responses of a prompt are all the "
            f"same, and algorithm.adv_estimator={estimator} compares a response with its group: every "
            "advantage would be zero and nothing would be learned. Sample with rollout.temperature > 0 "
            "(e.g. 1.0), or use rollout.n=1 with an estimator that needs no group (e.g. gae or remax)"
        )
    _check_filter_groups(cfg)
    _check_overlong_buffer(cfg)
    _check_reward_weights(cfg)
    _check_ray_ranks(cfg)
    _check_ray_resources(cfg)
    _check_harness(cfg)


def _check_filter_groups(cfg: PostTrainConfig) -> None:
    """algorithm.filter_groups (DAPO's dynamic sampling) needs a metric and groups whose samples can differ."""
    f, r = cfg.algorithm.filter_groups, cfg.rollout
    if not f.enable:
        return
    if f.metric is None:
        raise ConfigError(
            "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric, the per-sample value that "
            "must differ within a group for the group to be kept; set it to acc (the reward), score (the same), "
            "seq_reward (the reward with overlong shaping) or seq_final_reward"
        )
    if r.n < 2:
        raise ConfigError(
            f"algorithm.filter_groups.enable=true drops prompt groups whose samples all score the same, but with "
            f"rollout.n={r.n} every group has one sample and is always kept, so the filter does nothing; set "
            "rollout.n >= 2 (e.g. 8) or algorithm.filter_groups.enable=false"
        )
    if r.temperature == 0:
        raise ConfigError(
            "algorithm.filter_groups.enable=true with rollout.temperature=0: greedy decoding gives every sample "
            "of a prompt the same response, so every group would be dropped and no batch could be filled; "
            "sample with rollout.temperature > 0 (e.g. 1.0)"
        )
    if f.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError(
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true would need the "
            "KL penalty (old and reference log-probs) of every generated sample before filtering, which posttrain "
            "does not compute; filter on seq_reward (the reward before the KL penalty) or set "
            "algorithm.use_kl_in_reward=false"
        )


def _check_overlong_buffer(cfg: PostTrainConfig) -> None:
    """reward.overlong_buffer.len: a non-empty penalty zone inside the response budget."""
    o, limit = cfg.reward.overlong_buffer, cfg.data.max_response_length
    if not o.enable:
        return
    if not 1 <= o.len <= limit:
        raise ConfigError(
            f"reward.overlong_buffer.len={o.len} must be between 1 and data.max_response_length={limit}: it is "
            "the number of tokens before the response limit over which the overlong penalty grows from 0 to "
            f"reward.overlong_buffer.penalty_factor; e.g. reward.overlong_buffer.len={max(1, limit // 4)}"
        )


def _check_reward_weights(cfg: PostTrainConfig) -> None:
    """reward.rule_weight weighs the rule against a reward model or a judge; with neither, or with every weight
    0, it is a mistake (posttrain.rewards.combine)."""
    rw = cfg.reward
    if not rw.model.enable and rw.model.normalize:
        raise ConfigError(
            "reward.model.normalize=true applies when a reward model scores the samples, but "
            "reward.model.enable=false; enable one (reward.model.enable=true reward.model.path=DIR) or drop the key"
        )
    if not (rw.model.enable or rw.judge.enable or rw.prm.enable) and rw.rule_weight != 1.0:
        raise ConfigError(
            f"reward.rule_weight={rw.rule_weight} applies when a reward model, a judge or a process reward model "
            "scores the samples, but reward.model.enable=false, reward.judge.enable=false and "
            "reward.prm.enable=false; enable one (reward.model.enable=true "
            "reward.model.path=DIR, or reward.judge.enable=true ...) or drop the key"
        )
    parts = (
        (rw.model.enable, rw.model.weight),
        (rw.judge.enable, rw.judge.weight),
        (rw.prm.enable, rw.prm.weight),
    )
    weights = [rw.rule_weight] + [w for on, w in parts if on]
    if len(weights) > 1 and all(w == 0 for w in weights):
        raise ConfigError(
            "reward.rule_weight, reward.model.weight, reward.judge.weight and reward.prm.weight are all 0 (of the "
            "parts enabled), which leaves nothing to train on; give one a nonzero weight"
        )
    _check_judge(cfg)
    _check_prm(cfg)


# Estimators that credit each token with the rewards that follow it (GAE's values, REINFORCE++'s discounted
# returns); every other one sums a response's token rewards into one outcome score first.
TOKEN_LEVEL_ESTIMATORS = ("gae", "reinforce_plus_plus")


def _check_prm(cfg: PostTrainConfig) -> None:
    """reward.prm: a path, a separator that can cut a response, and a dense reduction only where the estimator
    credits tokens (the model directory itself is read by the preflight, before any weights load)."""
    p, estimator = cfg.reward.prm, cfg.algorithm.adv_estimator
    if not p.enable:
        return
    if not p.path:
        raise ConfigError(
            "reward.prm.enable=true needs reward.prm.path (a directory of an AutoModelForTokenClassification "
            "with two labels, e.g. one trained by `posttrain rm` on stepwise data)"
        )
    if p.reduction == "dense" and estimator not in TOKEN_LEVEL_ESTIMATORS:
        raise ConfigError(
            f"reward.prm.reduction=dense with algorithm.adv_estimator={estimator}: {estimator} sums a response's "
            "token rewards into one outcome score, so the step scores placed on their steps would only add up "
            "(no step gets credit of its own); set reward.prm.reduction=min, mean or last for an outcome "
            f"estimator, or use algorithm.adv_estimator in {list(TOKEN_LEVEL_ESTIMATORS)} for dense step rewards"
        )
    if p.separator_is_regex and not p.separator:
        raise ConfigError(
            "reward.prm.separator_is_regex=true needs reward.prm.separator (the regex that ends a step, e.g. "
            "'\\n+'); or set reward.prm.separator_is_regex=false to use the model's own step_separator"
        )
    if p.separator_is_regex:
        try:
            pattern = re.compile(p.separator)
        except re.error as exc:
            raise ConfigError(
                f"reward.prm.separator={p.separator!r} with reward.prm.separator_is_regex=true is not a valid "
                f"regular expression ({exc}); fix it, or set reward.prm.separator_is_regex=false to match it "
                "literally"
            ) from exc
        if pattern.fullmatch(""):
            raise ConfigError(
                f"reward.prm.separator={p.separator!r} matches the empty string, so it cannot cut a response "
                "into steps; use a pattern that always consumes text, e.g. '\\n+'"
            )


def _check_judge(cfg: PostTrainConfig) -> None:
    """reward.judge: exactly one of an endpoint (with a model name) or a local model, a rubric, and the API key's
    variable set (read here, before any model loads; the key itself never sits in the config)."""
    j = cfg.reward.judge
    if j.pairwise_opponents and j.mode != "pairwise":
        raise ConfigError(
            f"reward.judge.pairwise_opponents={j.pairwise_opponents} applies to reward.judge.mode=pairwise only "
            f"(it is {j.mode!r}); set reward.judge.mode=pairwise or drop the key"
        )
    if j.mode == "pairwise" and j.unparsed_score != 0.0:
        raise ConfigError(
            f"reward.judge.unparsed_score={j.unparsed_score} applies to reward.judge.mode=pointwise; in pairwise "
            "mode an unreadable verdict or a failed call counts as a tie (0.5 to each response); drop the key"
        )
    if not j.enable:
        return
    if j.mode == "pairwise" and cfg.rollout.n < 2:
        raise ConfigError(
            f"reward.judge.mode=pairwise compares the samples of one prompt, but rollout.n={cfg.rollout.n} draws "
            "one per prompt; set rollout.n >= 2 (e.g. rollout.n=4) or reward.judge.mode=pointwise"
        )
    if bool(j.base_url) == bool(j.path):
        given = f"reward.judge.base_url={j.base_url!r} and reward.judge.path={j.path!r}"
        raise ConfigError(
            f"reward.judge.enable=true needs exactly one of reward.judge.base_url (an endpoint, e.g. "
            f"http://127.0.0.1:8000/v1) or reward.judge.path (a model loaded here), but {given} "
            f"{'are both set' if j.base_url else 'are both empty'}; set one of them (docs/judges.md)"
        )
    if not j.rubric:
        raise ConfigError(
            "reward.judge.enable=true needs reward.judge.rubric, a YAML rubric file (format in docs/judges.md)"
        )
    if j.path:
        if j.api_key_env:
            raise ConfigError(
                f"reward.judge.api_key_env={j.api_key_env!r} names an API key, but reward.judge.path={j.path!r} is "
                "a local judge that sends no requests; set reward.judge.api_key_env='' (or judge through "
                "reward.judge.base_url instead)"
            )
        return
    if not j.model:
        raise ConfigError(
            "reward.judge.base_url is set but reward.judge.model is empty; set it to the model name the endpoint "
            "serves (its /v1/models lists them)"
        )
    if not j.base_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"reward.judge.base_url={j.base_url!r} must be an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1"
        )
    if j.api_key_env and not os.environ.get(j.api_key_env):
        raise ConfigError(
            f"reward.judge.api_key_env={j.api_key_env}: the environment variable {j.api_key_env} is not set (or "
            f"empty); export it with the judge endpoint's API key (export {j.api_key_env}=...), or set "
            "reward.judge.api_key_env='' for an endpoint that needs no key"
        )


# trainer.ray_* keys that only mean something when Ray places the trainer ranks.
RAY_RANK_KNOBS = (
    "ray_cpus_per_rank",
    "ray_gpus_per_rank",
    "ray_resources_per_rank",
    "ray_placement",
    "ray_max_restarts",
)


def _check_ray_ranks(cfg: PostTrainConfig) -> None:
    """trainer.ray_ranks: its knobs need it, and the device the ranks train on must be the one Ray gives
    them (Ray hides GPUs from a process that reserved none). Rules on the launch itself (not under torchrun,
    the batch plan for N ranks, Ray installed) are checked by the launcher, posttrain.rl.ray_ranks."""
    t = cfg.trainer
    if t.ray_ranks == 0:
        defaults = TrainerConfig()
        changed = [
            f"trainer.{k}={getattr(t, k)}" for k in RAY_RANK_KNOBS if getattr(t, k) != getattr(defaults, k)
        ]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)} configure(s) the trainer ranks Ray places, but trainer.ray_ranks=0 (this "
                "process, or torchrun's ranks, train); set trainer.ray_ranks=N to have Ray start N ranks, or "
                "drop those keys"
            )
        return
    if t.ray_gpus_per_rank > 0 and t.device == "cpu":
        raise ConfigError(
            f"trainer.ray_gpus_per_rank={t.ray_gpus_per_rank} reserves a GPU for each trainer rank, but "
            "trainer.device=cpu trains on CPU; set trainer.device=cuda (or auto), or trainer.ray_gpus_per_rank=0"
        )
    if t.ray_gpus_per_rank == 0 and t.device == "cuda":
        raise ConfigError(
            f"trainer.device=cuda with trainer.ray_ranks={t.ray_ranks}, but trainer.ray_gpus_per_rank=0: Ray "
            "gives a rank no GPU it did not reserve, so the ranks would find none; set "
            "trainer.ray_gpus_per_rank=1 (one GPU per rank), or trainer.device=cpu"
        )


# Resources with keys of their own (CPUs, GPUs) or that Ray manages itself: not custom resources.
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _check_ray_resources(cfg: PostTrainConfig) -> None:
    """The custom Ray resources of the trainer ranks and the rollout worker: positive amounts of custom
    resources, the rollout worker's only where Ray places it."""
    a = cfg.async_training
    if a.rollout_resources and not (a.enable and a.rollout_worker == "ray"):
        raise ConfigError(
            f"async_training.rollout_resources={a.rollout_resources} places the rollout worker Ray starts, but "
            f"async_training.enable={a.enable} and rollout_worker={a.rollout_worker}; set "
            "async_training.enable=true async_training.rollout_worker=ray, or drop the key"
        )
    for key, resources in (
        ("trainer.ray_resources_per_rank", cfg.trainer.ray_resources_per_rank),
        ("async_training.rollout_resources", a.rollout_resources),
    ):
        for name, amount in resources.items():
            if name in RAY_BUILTIN_RESOURCES:
                raise ConfigError(
                    f"{key}.{name}={amount}: {name} is not a custom resource; use the CPU and GPU keys beside "
                    f"it (ray_cpus_per_rank / ray_gpus_per_rank, rollout_num_cpus / rollout_num_gpus), and drop "
                    f"{key}.{name}"
                )
            if isinstance(amount, bool) or not isinstance(amount, int | float) or amount <= 0:
                raise ConfigError(
                    f"{key}.{name}={amount!r}: the amount of a Ray resource must be a number > 0 (e.g. "
                    f"{key}.{name}=1)"
                )


def _check_harness(cfg: PostTrainConfig) -> None:
    """A harness (harness.path or harness.command) owns the whole trajectory: one form of it, and none of the
    native agent loop's environment and tools beside it (the harness brings its own)."""
    h = cfg.harness
    if not harness_enabled(h):
        return
    if h.path and h.command:
        raise ConfigError(
            f"harness.path={h.path!r} and harness.command={h.command!r} are both set: a run has one harness; "
            "keep harness.path (a Python callable) or harness.command (an external program), not both"
        )
    key, value = ("harness.path", h.path) if h.path else ("harness.command", h.command)
    mt, env = cfg.rollout.multi_turn, cfg.env
    if env.path:
        raise ConfigError(
            f"{key}={value!r} with env.path={env.path!r}: a harness runs its own agent loop and environment, so "
            "posttrain's environment would never be called; drop env.path (or the harness)"
        )
    if env.kwargs:
        raise ConfigError(
            f"{key}={value!r} with env.kwargs={env.kwargs!r}: a harness has no posttrain environment to pass "
            "them to; drop env.kwargs (the harness gets each data row as it is)"
        )
    if mt.tool_config_path:
        raise ConfigError(
            f"{key}={value!r} with rollout.multi_turn.tool_config_path={mt.tool_config_path!r}: a harness sends "
            "its own tools with its requests; drop rollout.multi_turn.tool_config_path"
        )
    if mt.enable:
        raise ConfigError(
            f"{key}={value!r} with rollout.multi_turn.enable=true: a harness is its own multi-turn rollout "
            "(posttrain's agent loop and the harness cannot both play a trajectory); set "
            "rollout.multi_turn.enable=false (the harness still honours rollout.multi_turn.max_tokens_per_turn "
            "and rollout.multi_turn.turn_rewards)"
        )
