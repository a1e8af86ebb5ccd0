"""What a rollout needs, and nothing the trainer needs: the engine, the prompts and their sampler, the reward.

The trainer's :class:`posttrain.rl.build.Components` is a RolloutContext plus the trainer's own parts, so the
synchronous loop and the rollout thread pass it as it is; a rollout worker in its own process builds one from
the config alone (:func:`posttrain.rl.build.build_rollout_context`), without the actor, the critic or an
optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import RolloutBatch
from posttrain.data.datasets import TokenizedPrompts
from posttrain.data.sampler import PromptSampler
from posttrain.parallel.runtime import DistContext
from posttrain.parallel.shares import SINGLE_SHARE, DataShare
from posttrain.rewards.judge import JudgeScorer, PairwiseJudgeScorer
from posttrain.rewards.process_reward import ProcessReward
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.collect.harness_loop import HarnessLoop
from posttrain.rl.collect.multi_turn import AgentLoop
from posttrain.rl.teacher_routing import TeacherRoute
from posttrain.rollout.base import RolloutEngine


@dataclass
class RolloutContext:
    """The parts of a run that draw, generate and score a step's samples
    (``posttrain.rl.collect.phase.rollout_phase``) and validate (``posttrain.rl.collect.validation.validate``)."""

    cfg: PostTrainConfig
    engine: RolloutEngine
    tokenizer: object
    train_prompts: TokenizedPrompts
    val_prompts: TokenizedPrompts | None
    sampler: PromptSampler
    reward_runner: RewardRunner
    reward_model: RewardModelScorer | None
    dist: DistContext = DistContext()
    share: DataShare = SINGLE_SHARE
    agent: AgentLoop | HarnessLoop | None = None  # multi-turn runs: how trajectories are rolled out
    # Where the engine generates, "cpu" or "cuda": reward.score_during_generation=auto reads it.
    generation_device: str = "cpu"
    # reward.judge: an LLM judge's rubric scores (pointwise or pairwise), weighed in with the rule's
    judge: JudgeScorer | PairwiseJudgeScorer | None = None
    prm: ProcessReward | None = None  # reward.prm: a process reward model's step scores
    teacher_route: TeacherRoute | None = None  # distill.teachers: each row's teacher, by its data_source

    def close(self) -> None:
        self.reward_runner.close()
        if self.agent is not None:
            self.agent.close()
        self.engine.close()


@dataclass
class GeneratedStep:
    """One step's samples, their rollout metrics, and the prompt sampler's state before they were drawn."""

    batch: RolloutBatch
    metrics: dict[str, float]
    sampler_before: dict


@dataclass
class StartedStep:
    """What the trainer hears of a partial rollout's start: the prompt sampler's state before it drew."""

    sampler_before: dict
