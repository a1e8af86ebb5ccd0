"""LLM judge rewards: a rubric's criteria (``rubric``), rendered for and sent to an OpenAI-compatible endpoint
(``client``, ``calls``), verdicts read as scores (``verdict``) and combined per sample (``scorer``) or as win
rates within a prompt's group (``pairwise``); docs/judges.md."""

from __future__ import annotations

import os

from posttrain.rewards.judge.client import ChatEndpoint, JudgeUnavailable
from posttrain.rewards.judge.pairwise import PairwiseJudgeScorer
from posttrain.rewards.judge.rubric import load_rubric
from posttrain.rewards.judge.scorer import SUMMED, TIME, JudgeScorer

__all__ = ["SUMMED", "TIME", "JudgeScorer", "JudgeUnavailable", "PairwiseJudgeScorer", "build_judge"]


def build_judge(cfg) -> JudgeScorer | PairwiseJudgeScorer | None:
    """The judge of ``cfg.reward.judge`` (None when it is off): its rubric read and checked, its API key read
    from the variable reward.judge.api_key_env names (posttrain.config.validate checked it is set).
    Both kinds score with ``score(samples, groups)``; ``groups[s]``: the prompt sample s answers."""
    j = cfg.reward.judge
    if not j.enable:
        return None
    endpoint = ChatEndpoint(
        j.base_url,
        j.model,
        api_key=os.environ.get(j.api_key_env, "") if j.api_key_env else "",
        timeout_s=j.timeout_s,
        max_retries=j.max_retries,
        backoff_s=j.backoff_s,
        max_failures=j.max_failures,
        max_tokens=j.max_tokens,
        temperature=j.temperature,
    )
    if j.mode == "pairwise":
        rubric = load_rubric(j.rubric, pairwise=True)
        return PairwiseJudgeScorer(endpoint, rubric, j.pairwise_opponents, j.max_concurrency, j.cache)
    return JudgeScorer(endpoint, load_rubric(j.rubric), j.unparsed_score, j.max_concurrency, j.cache)
