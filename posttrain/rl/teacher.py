"""The distillation teacher (`distill.*`): its checks from the config alone, its model directory, the tokenizer
check against the student, and the frozen module, built in one place (docs/distillation.md)."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from posttrain.config.errors import ConfigError, MissingPathError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.distill import distill_enabled
from posttrain.forward.lm_head import check_plain_lm_head
from posttrain.forward.options import attn_implementation
from posttrain.models.hf import load_causal_lm, load_tokenizer, resolve_dtype
from posttrain.models.hub import looks_like_hub_id, resolve_hub_model
from posttrain.models.model_path import WarmStart, builtin_base_dir
from posttrain.models.prepare import check_packing, read_model_config
from posttrain.parallel.fsdp import shard_model
from posttrain.parallel.runtime import DistContext


def check_distill(cfg: PostTrainConfig, world_size: int = 1) -> None:
    """The `distill.*` rules that need neither weights nor data; ConfigError naming the keys and a fix."""
    d, est = cfg.distill, cfg.algorithm.adv_estimator
    teacher = distill_enabled(d)
    if d.teachers:
        _check_routed_teachers(cfg, world_size)
    if d.teacher.base_url:
        check_remote_teacher(cfg)
    if est == "opd" and not teacher:
        raise ConfigError(
            "algorithm.adv_estimator=opd distills a teacher into the policy, but distill.teacher.path is empty; "
            "set distill.teacher.path (a model directory, a run directory or builtin:...), distill.teacher.base_url "
            "(a remote teacher) or distill.teachers"
        )
    if est == "opd" and d.opd_coef > 0:
        raise ConfigError(
            f"distill.opd_coef={d.opd_coef} adds the OPD term to another estimator's advantages, but "
            "algorithm.adv_estimator=opd already is that term alone; set distill.opd_coef=0, or choose the "
            "reward's estimator (e.g. algorithm.adv_estimator=grpo) to combine both"
        )
    if d.opd_coef > 0 and not teacher:
        raise ConfigError(
            f"distill.opd_coef={d.opd_coef} needs a teacher; set distill.teacher.path or distill.opd_coef=0"
        )
    if teacher and est != "opd" and d.opd_coef == 0 and d.gkd_coef == 0:
        raise ConfigError(
            f"distill.teacher.path={d.teacher.path!r} is set but nothing uses the teacher: set "
            "algorithm.adv_estimator=opd (distillation alone), distill.opd_coef > 0 (added to "
            f"algorithm.adv_estimator={est}'s advantages) or distill.gkd_coef > 0, or clear distill.teacher.path"
        )
    if d.gkd_coef > 0 and not d.teacher.base_url:
        _check_gkd(cfg, world_size)
    if d.top_k and not teacher:
        raise ConfigError(
            f"distill.top_k={d.top_k} reports the teacher's top-k overlap; set distill.teacher.path"
        )
    if not teacher:
        return
    sp = cfg.actor.ulysses_sequence_parallel_size
    if sp > 1 and not d.teacher.base_url:
        raise ConfigError(
            f"distill.teacher.path with actor.ulysses_sequence_parallel_size={sp}: the teacher pass does not "
            "run with Ulysses sequence parallelism yet; set actor.ulysses_sequence_parallel_size=1"
        )
    for path in (d.teacher.path, *d.teachers.values()):
        config = read_model_config(path) if path and Path(path, "config.json").exists() else None
        if d.teacher.use_remove_padding and config is not None:
            check_packing("distill.teacher.use_remove_padding", config)


def check_remote_teacher(cfg: PostTrainConfig) -> None:
    """``distill.teacher.base_url``: a URL, a model name, the API key's variable set (read here, before any model
    loads), and nothing that needs more than the sampled tokens' log-probs."""
    t, d = cfg.distill.teacher, cfg.distill
    if t.path:
        raise ConfigError(
            f"distill.teacher.base_url={t.base_url!r} and distill.teacher.path={t.path!r} are both set: a "
            "teacher is either remote or loaded here; clear one of them"
        )
    if not t.base_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"distill.teacher.base_url={t.base_url!r} must be an http:// or https:// URL, e.g. "
            "http://127.0.0.1:8000/v1"
        )
    if not t.model:
        raise ConfigError(
            "distill.teacher.base_url is set but distill.teacher.model is empty; set it to the model name the "
            "server serves (its /v1/models lists them)"
        )
    if t.api_key_env and not os.environ.get(t.api_key_env):
        raise ConfigError(
            f"distill.teacher.api_key_env={t.api_key_env}: the environment variable {t.api_key_env} is not set "
            f"(or empty); export it with the teacher server's API key (export {t.api_key_env}=...), or set "
            "distill.teacher.api_key_env='' for a server that needs no key"
        )
    refused = []
    if d.gkd_coef > 0:
        refused.append(
            f"distill.gkd_coef={d.gkd_coef} (GKD needs the teacher's whole next-token distribution, which a "
            "completions server does not return): set distill.gkd_coef=0"
        )
    if d.top_k > 0:
        refused.append(f"distill.top_k={d.top_k} (the overlap needs the teacher's top-k token ids): set 0")
    if d.teachers:
        refused.append("distill.teachers (routed teachers are local models): clear distill.teachers")
    if refused:
        raise ConfigError(
            f"distill.teacher.base_url={t.base_url!r} is not supported with " + "; ".join(refused)
        )


def _check_routed_teachers(cfg: PostTrainConfig, world_size: int) -> None:
    """``distill.teachers``: non-empty data_source keys and paths, one rank, no GKD term."""
    d = cfg.distill
    for source, path in d.teachers.items():
        if not source or not isinstance(path, str) or not path:
            raise ConfigError(
                f"distill.teachers.{source}={path!r}: each entry maps a data_source to a teacher path; give a "
                "non-empty data_source and a model directory, a run directory or builtin:tiny / builtin:base"
            )
    refused = []
    if world_size > 1:
        refused.append(f"{world_size} ranks (each rank's rows of a teacher differ): train on one rank")
    if d.gkd_coef > 0:
        refused.append(f"distill.gkd_coef={d.gkd_coef} (GKD has one teacher): set distill.gkd_coef=0")
    if refused:
        raise ConfigError(f"distill.teachers={d.teachers} is not supported with " + "; ".join(refused))


def _check_gkd(cfg: PostTrainConfig, world_size: int) -> None:
    """The GKD loss term: a teacher, one rank, no LoRA, plain LM heads on both models."""
    d = cfg.distill
    if not d.teacher.path:
        raise ConfigError(
            f"distill.gkd_coef={d.gkd_coef} needs a teacher; set distill.teacher.path or distill.gkd_coef=0"
        )
    refused = []
    if world_size > 1:
        refused.append(
            f"{world_size} ranks (the sharded LM heads are not gathered for it yet): train on one rank"
        )
    if cfg.model.lora_rank > 0 or cfg.model.lora_adapter_path:
        refused.append("a LoRA student (not verified yet): set model.lora_rank=0")
    if refused:
        raise ConfigError(f"distill.gkd_coef={d.gkd_coef} is not supported with " + "; ".join(refused))
    for path in (cfg.model.path, d.teacher.path):
        config = read_model_config(path) if Path(path, "config.json").exists() else None
        if config is not None:
            check_plain_lm_head(config, "distill.gkd_coef")


def resolve_teacher_path(
    cfg: PostTrainConfig,
    warm_start: WarmStart | None,
    quiet: bool = False,
    given: str | None = None,
    key: str = "distill.teacher.path",
) -> Path:
    """The teacher's model directory: builtin:tiny (the demo's warm start) / builtin:base, a run directory's
    final_model/, a model directory, or a Hub id. ``given``/``key``: another teacher's path and its key
    (``distill.teachers.SOURCE``); by default ``distill.teacher.path``."""
    given = cfg.distill.teacher.path if given is None else given
    if given == "builtin:tiny":
        if warm_start is None:
            raise ValueError("resolve_teacher_path met builtin:tiny but was given no warm_start to build it")
        return warm_start(cfg, quiet)
    if given == "builtin:base":
        return builtin_base_dir(cfg)
    if given.startswith("builtin:"):
        raise ConfigError(f"{key}={given!r} is not a built-in model; use builtin:tiny or builtin:base")
    path = Path(given)
    if (path / "final_model" / "config.json").exists():
        return path / "final_model"
    if (path / "config.json").exists():
        return path
    if not path.exists() and looks_like_hub_id(given):
        return resolve_hub_model(given)
    raise MissingPathError(
        f"{key}={given!r} is neither a model directory (config.json), a run directory with "
        "final_model/, nor a Hub id; give one of those or builtin:tiny / builtin:base"
    )


def judge_dir(cfg: PostTrainConfig, warm_start: WarmStart | None, quiet: bool = False) -> Path | None:
    """The model directory of a local judge (``reward.judge.path``, read as a teacher's path is), or None when
    the judge is off or an endpoint."""
    j = cfg.reward.judge
    if not (j.enable and j.path):
        return None
    return resolve_teacher_path(cfg, warm_start, quiet, given=j.path, key="reward.judge.path")


def check_same_tokenizer(
    student_dir: Path,
    teacher_dir: Path,
    student_key: str = "model.path",
    teacher_key: str = "distill.teacher.path",
) -> None:
    """The teacher scores the student's token ids, so both must map ids to the same strings and agree on the
    special tokens; ConfigError naming both directories otherwise (before any weights load)."""
    student, teacher = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    differences = []
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only = len(set(sv.items()) ^ set(tv.items()))
        differences.append(
            f"vocabularies differ ({len(sv)} vs {len(tv)} entries, {only} id/token pairs unshared)"
        )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            differences.append(f"{name} {getattr(student, name)} vs {getattr(teacher, name)}")
    if differences:
        raise ConfigError(
            f"the teacher's tokenizer ({teacher_key} -> {teacher_dir}) is not the student's ({student_key} "
            f"-> {student_dir}): {'; '.join(differences)}. The teacher scores the student's token ids, so it "
            "needs the same tokenizer: distil from a teacher of the same family, or train a student with the "
            "teacher's tokenizer"
        )


def build_teacher(cfg: PostTrainConfig, teacher_dir: Path, dist: DistContext) -> nn.Module:
    """The teacher, frozen, in ``distill.teacher.dtype`` on this rank's device; FSDP2-sharded like the reference
    policy with several ranks (``distill.teacher.fsdp_config``)."""
    t = cfg.distill.teacher
    grouped = cfg.actor.use_prefix_grouper and not t.use_remove_padding  # the teacher pass's layout
    attn = attn_implementation(bool(t.use_remove_padding), dist.device, grouped)
    teacher = load_causal_lm(teacher_dir, t.dtype, dist.device, attn).eval().requires_grad_(False)
    if dist.distributed:
        shard_model(teacher, dist, t.fsdp_config, resolve_dtype(t.dtype))
    return teacher
