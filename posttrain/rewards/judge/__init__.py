"""LLM judge rewards: a rubric's criteria (``rubric``), rendered for and sent to an OpenAI-compatible endpoint
(``client``, ``calls``) or a model loaded in this process (``local``), verdicts read as scores (``verdict``) and
combined per sample (``scorer``) or as win rates within a prompt's group (``pairwise``); docs/judges.md."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from posttrain.rewards.judge.client import ChatEndpoint, JudgeUnavailable
from posttrain.rewards.judge.local import LocalJudge
from posttrain.rewards.judge.pairwise import PairwiseJudgeScorer
from posttrain.rewards.judge.rubric import load_rubric
from posttrain.rewards.judge.scorer import SUMMED, TIME, JudgeScorer

__all__ = [
    "SUMMED",
    "TIME",
    "JudgeScorer",
    "JudgeUnavailable",
    "LocalJudge",
    "PairwiseJudgeScorer",
    "build_judge",
]


def build_judge(
    cfg, judge_dir: Path | None = None, device: str | torch.device = "cpu"
) -> JudgeScorer | PairwiseJudgeScorer | None:
    """The judge of ``cfg.reward.judge`` (None when it is off), its rubric read and checked first: an endpoint,
    its API key read from the variable reward.judge.api_key_env names (posttrain.config.validate checked it is
    set), or, with reward.judge.path, the model in ``judge_dir`` (that path resolved by the caller) loaded on
    ``device``. Both kinds score with ``score(samples, groups)``; ``groups[s]``: the prompt sample s answers."""
    j = cfg.reward.judge
    if not j.enable:
        return None
    pairwise = j.mode == "pairwise"
    rubric = load_rubric(j.rubric, pairwise=pairwise)
    if j.path:
        if judge_dir is None:
            raise ValueError("build_judge needs judge_dir, reward.judge.path resolved, for a local judge")
        endpoint = LocalJudge(
            judge_dir,
            max_tokens=j.max_tokens,
            temperature=j.temperature,
            batch_size=j.batch_size,
            dtype=j.dtype or cfg.model.dtype,
            device=device,
        )
    else:
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
    if pairwise:
        return PairwiseJudgeScorer(endpoint, rubric, j.pairwise_opponents, j.max_concurrency, j.cache)
    return JudgeScorer(endpoint, rubric, j.unparsed_score, j.max_concurrency, j.cache)
