"""On-policy distillation (OPD): a teacher's per-token signal on the student's own samples.

The sampled-token OPD advantage (Thinking Machines' on-policy distillation; slime's ``--use-opd``, NeMo-RL's
``adv_estimator: opd``) is the negative per-token reverse-KL estimate on the sampled token::

    A_t = sg[ log pi_teacher(y_t | y_<t) - log pi_student(y_t | y_<t) ]      on trained tokens, 0 elsewhere

With it as the advantage of the policy-gradient loss, the expected update is the gradient of
``-KL(pi_student || pi_teacher)`` over the states the student visits. It is an estimator of its own
(``algorithm.adv_estimator=opd``: no reward needed) or a term added with a weight to any estimator's
advantages (:func:`add_opd_advantage`, ``distill.opd_coef``). Which student log-prob enters, and why, is in
docs/distillation.md: the old policy's (the trainer's own forward of the weights being updated).
"""

from __future__ import annotations

import torch

from posttrain.algorithms.estimator_registry import AdvantageInputs, register_advantage_estimator
from posttrain.algorithms.groups import float_mask


@torch.no_grad()
def opd_advantage(
    teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``[B, T]`` ``(teacher - student) * mask`` in fp32, without gradient: 0 on masked tokens (prompt pads,
    environment tokens of multi-turn trajectories, tokens rejected by the rollout correction)."""
    if teacher_log_probs.shape != student_log_probs.shape or teacher_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"teacher log-probs {tuple(teacher_log_probs.shape)}, student log-probs "
            f"{tuple(student_log_probs.shape)} and response mask {tuple(response_mask.shape)} must be one [B, T]"
        )
    mask = response_mask.to(torch.float32)
    return (teacher_log_probs.float() - student_log_probs.float()) * mask


@register_advantage_estimator("opd")
def compute_opd_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure on-policy distillation: the advantage is :func:`opd_advantage` alone (rewards are not used).

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor twice, in the rewards' dtype.
    """
    mask = float_mask(inputs.token_level_rewards, inputs.response_mask)
    if inputs.teacher_log_probs is None or inputs.student_log_probs is None:
        raise ValueError("advantage estimator 'opd' needs teacher and student log-probs; got None")
    adv = opd_advantage(inputs.teacher_log_probs, inputs.student_log_probs, mask)
    adv = adv.to(inputs.token_level_rewards.dtype)
    return adv, adv


@torch.no_grad()
def add_opd_advantage(
    advantages: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """``advantages + coef * A_opd`` (slime's OPD penalty on any estimator): the estimator's advantages are
    left as computed (group statistics see the reward only), then the teacher's per-token term is added."""
    opd = opd_advantage(teacher_log_probs, student_log_probs, response_mask)
    return advantages + coef * opd.to(advantages.dtype)


@torch.no_grad()
def distill_sums(
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    in_top_k: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-token sums behind the ``distill/*`` metrics (to be summed over ranks, then divided by
    ``tokens``): the reverse-KL estimate ``student - teacher`` (k1, the negative OPD advantage), the
    teacher's log-prob, and (with ``in_top_k``) the sampled tokens in the teacher's top-k."""
    mask = response_mask.to(torch.float32)
    teacher, student = teacher_log_probs.float(), student_log_probs.float()
    sums = {
        "tokens": float(mask.sum()),
        "reverse_kl": float(((student - teacher) * mask).sum()),
        "teacher_logprob": float((teacher * mask).sum()),
    }
    if in_top_k is not None:
        sums["top_k_overlap"] = float((in_top_k.float() * mask).sum())
    return sums
