"""Pure-tensor RL algorithms: advantage estimators, policy/value losses, KL, loss aggregation.

Every function takes and returns tensors (no model, no distribution, no config objects); registries are keyed by
the config names, so a trainer looks a component up by the string in its config.
"""

from posttrain.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATORS_NEEDING_CRITIC,
    RECOMMENDED_LOSS_AGG_MODE,
    AdvantageInputs,
    compute_drgrpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    get_advantage_estimator,
    needs_critic,
)
from posttrain.algorithms.aggregation import (
    LOSS_AGG_MODES,
    LossNormalizer,
    aggregate_loss,
    check_loss_agg_mode,
)
from posttrain.algorithms.kl import (
    KL_CONTROLLER_KINDS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)
from posttrain.algorithms.logprobs import (
    entropy_from_logits,
    logprobs_from_logits,
)
from posttrain.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from posttrain.algorithms.outcome_estimators import (
    compute_gpg_advantages,
    compute_grpo_passk_advantages,
    compute_opo_advantages,
)
from posttrain.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossInputs,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    get_policy_loss,
)
from posttrain.algorithms.rollout_correction import (
    check_rollout_correction,
    compute_rollout_correction,
    rollout_correction_kwargs,
)
from posttrain.algorithms.rollout_mismatch import (
    compute_rollout_is_weights,
    compute_rollout_rejection_mask,
    compute_token_veto_mask,
    mismatch_metrics,
)
from posttrain.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageInputs",
    "PolicyLossInputs",
    "ESTIMATORS_NEEDING_CRITIC",
    "KL_CONTROLLER_KINDS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "RECOMMENDED_LOSS_AGG_MODE",
    "AdaptiveKLController",
    "FixedKLController",
    "LossNormalizer",
    "aggregate_loss",
    "apply_kl_penalty",
    "check_loss_agg_mode",
    "check_rollout_correction",
    "compute_drgrpo_advantages",
    "compute_gae_advantages",
    "compute_gpg_advantages",
    "compute_grpo_advantages",
    "compute_grpo_passk_advantages",
    "compute_opo_advantages",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_remax_advantages",
    "compute_rollout_correction",
    "compute_rollout_is_weights",
    "compute_rollout_rejection_mask",
    "compute_rloo_advantages",
    "compute_token_veto_mask",
    "compute_value_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "needs_critic",
    "rollout_correction_kwargs",
]
