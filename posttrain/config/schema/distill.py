"""On-policy distillation: a frozen teacher scores the student's own samples (docs/distillation.md)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import knob, section
from posttrain.config.schema.names import DTYPES
from posttrain.config.schema.roles import ShardingConfig


@dataclass
class TeacherConfig:
    """The frozen teacher model: loaded, micro-batched and sharded like the reference policy."""

    path: str = knob(
        "",
        "The teacher: a Hugging Face model directory, a run directory (its final_model/ is loaded) or "
        "builtin:tiny / builtin:base. Empty: no teacher (or a remote one, distill.teacher.base_url). It must "
        "use the student's tokenizer.",
    )
    base_url: str = knob(
        "",
        "A remote teacher instead of distill.teacher.path: an OpenAI-compatible API base URL (e.g. "
        "http://127.0.0.1:8000/v1 of a vLLM server or `posttrain serve`) whose <base_url>/completions scores "
        "the student's token ids (echo with prompt log-probs). It must serve a model with the student's "
        "tokenizer (not checked). Empty: no remote teacher.",
    )
    model: str = knob(
        "", "The remote teacher's model name sent with each request (its /v1/models lists them)."
    )
    api_key_env: str = knob(
        "",
        "Name of the environment variable holding the remote teacher's API key (sent as a Bearer token); the "
        "key itself is never in the config. Empty: no key sent. A variable that is not set stops the run "
        "before any model loads.",
    )
    timeout_s: float = knob(
        120.0, "Seconds one remote teacher request may take before it is tried again.", min=0.001
    )
    max_retries: int = knob(
        3,
        "Tries after a failed remote teacher request (connection, timeout, HTTP error, a reply without the "
        "log-probs); when all fail the run stops with a message naming the endpoint.",
        min=0,
    )
    backoff_s: float = knob(
        1.0,
        "Wait before the first retry of a remote teacher request; doubled before each further one.",
        unit="seconds",
        min=0.0,
    )
    max_concurrency: int = knob(
        8, "Remote teacher requests (one per sample) in flight at once (per rank).", unit="requests", min=1
    )
    dtype: str | None = knob(
        None,
        "Parameter and compute dtype of the teacher; null: the same as model.dtype.",
        choices=(None, *DTYPES),
    )
    log_prob_micro_batch_size_per_gpu: int = knob(
        64, "Samples per teacher forward pass.", unit="samples per DP rank", min=1
    )
    log_prob_max_token_len_per_gpu: int = knob(
        32768,
        "Token budget of one teacher forward pass when distill.teacher.log_prob_use_dynamic_bsz is on.",
        unit="tokens per GPU",
        min=1,
    )
    log_prob_use_dynamic_bsz: bool | None = knob(
        None,
        "Form teacher micro-batches by token budget (distill.teacher.log_prob_max_token_len_per_gpu) instead of "
        "count. null: the same as actor.use_dynamic_bsz.",
    )
    use_remove_padding: bool | None = knob(
        None,
        "Pack the teacher's micro-batches without pads (rows of model.remove_padding_max_row_tokens). "
        "null: the same as model.use_remove_padding.",
    )
    logprob_chunk_size: int | None = knob(
        None,
        "Tokens per chunk of the teacher's LM head: its log-probs (and top-k check) are computed that many "
        "response tokens at a time, never as one [tokens, vocab] fp32 logits tensor. 0: all tokens at once. "
        "null: as the reference policy (ref.entropy_from_logits_chunk_size when "
        "ref.entropy_from_logits_with_chunking, else all at once).",
        unit="tokens",
        min=0,
    )
    fsdp_config: ShardingConfig = section(ShardingConfig)


def teacher_head_chunk(teacher: TeacherConfig, ref: object) -> int | None:
    """Tokens per chunk of the teacher's LM head (None: all at once), resolved from ``ref`` when unset."""
    if teacher.logprob_chunk_size is not None:
        return teacher.logprob_chunk_size or None
    return ref.entropy_from_logits_chunk_size if ref.entropy_from_logits_with_chunking else None


@dataclass
class DistillConfig:
    """Distillation from a teacher on the student's own samples: the sampled-token OPD advantage
    ``A_t = log pi_teacher(y_t) - log pi_student(y_t)`` (no gradient through it)."""

    teacher: TeacherConfig = section(TeacherConfig)
    teachers: dict[str, str] = knob(
        default_factory=dict,
        help="A teacher per data_source (distill.teachers.DATA_SOURCE=PATH, PATH as distill.teacher.path): each "
        "row is scored by the teacher of its data_source; rows of other sources by distill.teacher.path, or, "
        "when it is empty, by no teacher (their OPD advantage is 0: they train on the reward alone; counted "
        "in distill/rows/none). Every other setting is distill.teacher's. Each DATA_SOURCE must occur in the "
        "training data. One rank, no GKD.",
    )
    opd_coef: float = knob(
        0.0,
        "Weight of the OPD advantage added to algorithm.adv_estimator's advantages on trained tokens (GRPO + "
        "OPD, as slime's --opd-kl-coef). 0: not added. With algorithm.adv_estimator=opd the advantage is the "
        "OPD term alone and this key must stay 0.",
        min=0.0,
    )
    top_k: int = knob(
        0,
        "Report distill/top_k_overlap: the share of sampled tokens among the teacher's top_k tokens at their "
        "position (verl's overlap ratio). 0: off (it costs a top-k over the teacher's vocabulary per token).",
        unit="tokens",
        min=0,
    )

    gkd_coef: float = knob(
        0.0,
        "Weight of GKD's generalized Jensen-Shannon divergence between the student's and the teacher's whole "
        "next-token distributions on the student's samples, added to the actor's loss (aggregated as "
        "actor.loss_agg_mode). 0: off. One rank, no LoRA, plain LM heads.",
        min=0.0,
    )
    gkd_beta: float = knob(
        0.5,
        "GKD's beta: 0 is the forward KL(teacher || student), 1 the reverse KL(student || teacher).",
        min=0.0,
        max=1.0,
    )
    gkd_temperature: float = knob(1.0, "Temperature of both distributions in the GKD term.", min=1e-6)
    gkd_top_k: int = knob(
        0,
        "GKD over the teacher's top_k tokens at each position, both distributions renormalised there; 0: the "
        "whole vocabulary.",
        unit="tokens",
        min=0,
    )
    gkd_chunk_size: int = knob(
        1024,
        "Tokens per chunk of the GKD term (each chunk's [tokens, vocab] logits are recomputed in backward).",
        unit="tokens",
        min=1,
    )


def distill_enabled(d: DistillConfig) -> bool:
    """Whether a teacher takes part in the run."""
    return bool(d.teacher.path) or bool(d.teacher.base_url) or bool(d.teachers)
