"""The typed configuration schema: the only place where posttrain's defaults live (this package; one module
per family of sections, the whole config here).

Units are fixed here once (see docs/config.md for the full table):
- "prompts" counts unique prompts; "samples" counts prompt x response pairs (prompts x rollout.n).
- "global" sizes are for the whole job; "per_gpu" sizes are per data-parallel (DP) rank: with
  Ulysses sequence parallelism several GPUs share one DP rank, as in verl.
- token budgets (*_max_token_len_per_gpu) count the prompt + response tokens one GPU holds: a DP rank's
  micro-batch holds budget x ulysses_sequence_parallel_size tokens, split over its SP group (verl's convention).

YAML files and command-line overrides only override these defaults; an unknown key is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import section
from posttrain.config.schema.agents import EnvConfig
from posttrain.config.schema.algorithm import (
    AlgorithmConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
)
from posttrain.config.schema.distill import DistillConfig, TeacherConfig
from posttrain.config.schema.harness import HarnessConfig
from posttrain.config.schema.model import DataConfig, ModelConfig
from posttrain.config.schema.names import ADV_ESTIMATORS, DTYPES, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from posttrain.config.schema.rewards import OverlongBufferConfig, RewardConfig, RewardModelConfig
from posttrain.config.schema.rm import RMConfig
from posttrain.config.schema.roles import (
    ActorConfig,
    CriticConfig,
    FSDPConfig,
    OptimConfig,
    RefConfig,
    ShardingConfig,
)
from posttrain.config.schema.rollout import RolloutConfig
from posttrain.config.schema.run import AsyncTrainingConfig, CollapseConfig, SFTConfig, TrainerConfig
from posttrain.config.schema.sandbox import SandboxConfig

__all__ = [
    "ADV_ESTIMATORS",
    "ActorConfig",
    "AsyncTrainingConfig",
    "AlgorithmConfig",
    "CollapseConfig",
    "CriticConfig",
    "DTYPES",
    "DataConfig",
    "DistillConfig",
    "FSDPConfig",
    "FilterGroupsConfig",
    "HarnessConfig",
    "KLControlConfig",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "POLICY_LOSSES",
    "PostTrainConfig",
    "RefConfig",
    "RMConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SFTConfig",
    "SandboxConfig",
    "ShardingConfig",
    "TeacherConfig",
    "TrainerConfig",
]


@dataclass
class PostTrainConfig:
    """The whole posttrain configuration."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    actor: ActorConfig = section(ActorConfig)
    ref: RefConfig = section(RefConfig)
    critic: CriticConfig = section(CriticConfig)
    distill: DistillConfig = section(DistillConfig)
    reward: RewardConfig = section(RewardConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    trainer: TrainerConfig = section(TrainerConfig)
    async_training: AsyncTrainingConfig = section(AsyncTrainingConfig)
    sft: SFTConfig = section(SFTConfig)
    sandbox: SandboxConfig = section(SandboxConfig)
    env: EnvConfig = section(EnvConfig)
    harness: HarnessConfig = section(HarnessConfig)
    rm: RMConfig = section(RMConfig)
