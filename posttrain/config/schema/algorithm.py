"""Advantage estimation, the in-reward KL penalty and rollout-mismatch correction."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import knob, section
from posttrain.config.schema.names import ADV_ESTIMATORS, KL_ESTIMATORS


@dataclass
class KLControlConfig:
    """The coefficient of the in-reward KL penalty."""

    type: str = knob(
        "fixed", "Fixed or adaptive (PPO-style target KL) coefficient.", choices=("fixed", "adaptive")
    )
    kl_coef: float = knob(0.001, "(Initial) KL penalty coefficient.", min=0.0)
    target_kl: float = knob(0.1, "Adaptive controller's target KL per token.", min=0.0)
    horizon: int = knob(10000, "Adaptive controller's horizon.", unit="samples", min=1)


@dataclass
class RolloutCorrectionConfig:
    """How the policy that sampled the responses enters the PPO ratio, and how the rollout-training gap is corrected."""

    bypass_mode: bool = knob(
        False,
        "Use the log-probs the rollout engine computed while sampling as the old log-probs, skipping the "
        "actor's old-log-prob pass. Exact when the engine runs the actor's weights in the actor's dtype "
        "(the native engine on one process); otherwise the ratio is taken against the rollout policy.",
    )
    rollout_is: str | None = knob(
        None,
        "Multiply each token's policy loss by a truncated importance weight old/rollout probability, computed per "
        "token or once per sequence (product over its tokens); null leaves the loss unweighted (metrics are still "
        "logged when rollout log-probs exist).",
        choices=(None, "token", "sequence"),
    )
    rollout_is_threshold: float = knob(
        2.0,
        "Cap on the importance weights of rollout_is (weights above it are set to it).",
        min=1.0,
    )
    rollout_rs: str | None = knob(
        None,
        "Drop outliers from the response mask when the old/rollout probability ratio leaves "
        "[rollout_rs_threshold_lower, rollout_rs_threshold]: single tokens ('token'), or whole responses by the "
        "product ('sequence') or geometric mean ('geometric') of their token ratios; null keeps everything.",
        choices=(None, "token", "sequence", "geometric"),
    )
    rollout_rs_threshold: float | None = knob(
        None,
        "Upper ratio bound of rollout_rs; required when rollout_rs is set (geometric needs values near 1, "
        "e.g. 1.001).",
        min=1.0,
    )
    rollout_rs_threshold_lower: float | None = knob(
        None,
        "Lower ratio bound of rollout_rs; null means 1 / rollout_rs_threshold.",
        min=0.0,
        max=1.0,
    )
    rollout_token_veto_threshold: float | None = knob(
        None,
        "Drop a whole response from the mask when any of its tokens has an old/rollout probability ratio below "
        "this (e.g. 1e-4); applies whatever rollout_is and rollout_rs are; null disables it.",
        min=0.0,
        max=1.0,
    )


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's `filter_groups`): keep only prompt groups whose samples differ, and
    generate more batches until data.train_batch_size such groups are found."""

    enable: bool = knob(
        False,
        "Drop prompt groups whose `metric` is the same for every sample (they give no GRPO signal) and keep "
        "generating batches of data.train_batch_size prompts until enough groups are left; needs rollout.n >= 2.",
    )
    metric: str | None = knob(
        None,
        "What must differ within a group: 'acc' or 'score' (the reward before overlong shaping), 'seq_reward' "
        "(after it), 'seq_final_reward' (the reward trained on; the same as seq_reward here, since the in-reward "
        "KL penalty is not supported with filtering). Required when enable is true.",
        choices=(None, "acc", "score", "seq_reward", "seq_final_reward"),
    )
    max_num_gen_batches: int = knob(
        0,
        "Most generation batches one step may draw; the step fails with an error when they are used up before "
        "enough groups are kept. 0 or negative: no limit.",
        unit="batches",
    )


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the in-reward KL penalty."""

    adv_estimator: str = knob("grpo", "Advantage estimator; 'gae' trains a critic.", choices=ADV_ESTIMATORS)
    gamma: float = knob(1.0, "Discount factor.", min=0.0, max=1.0)
    lam: float = knob(1.0, "GAE lambda.", min=0.0, max=1.0)
    norm_adv_by_std_in_grpo: bool = knob(True, "Divide GRPO (and grpo_passk) advantages by the group's std.")
    use_kl_in_reward: bool = knob(False, "Subtract a per-token KL penalty from the rewards.")
    kl_penalty: str = knob("k1", "KL estimator of the in-reward penalty.", choices=KL_ESTIMATORS)
    kl_ctrl: KLControlConfig = section(KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig)
    mask_truncated_samples: bool = knob(
        False,
        "Leave responses cut off at data.max_response_length (finish reason 'length') out of the loss: their "
        "response mask is zeroed; their reward still counts in their group's baseline (DAPO's overlong "
        "filtering; posttrain's key, verl has none).",
    )
