"""On-policy distillation end to end: a teacher equal to the student leaves the policy exactly unchanged, a
different teacher trains it (OPD alone and GRPO + OPD) with the distill/* metrics, environment tokens get
no gradient, the teacher pass gives the same numbers in every micro-batch layout, and what cannot work is a
ConfigError before any weights load."""

import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.algorithms.advantages import AdvantageInputs, get_advantage_estimator
from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.algorithms.gkd import generalized_jsd
from posttrain.config.errors import ConfigError
from posttrain.config.plan import build_plan
from posttrain.config.schema import ActorConfig, DistillConfig
from posttrain.data.batch import build_rollout_batch
from posttrain.forward.passes import ForwardOptions, policy_logprobs
from posttrain.forward.teacher import teacher_scores
from posttrain.models.hf import load_causal_lm
from posttrain.planning.memory import estimate_memory
from posttrain.planning.shape import ModelShape
from posttrain.rl.build import build_components
from posttrain.rl.train_command import run_training
from posttrain.train.losses import TeacherTerm, actor_loss_fn
from posttrain.train.update import forward_in_micro_batches
from tests.helpers import assert_fp32_close, assert_grads_equal, read_metrics, small_config

DISTILL_METRICS = ("distill/reverse_kl", "distill/teacher_logprob", "distill/advantage_mean")


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "extra",
    [
        [],
        # the rollout's log-probs differ from the old policy's in neither case here; rollout correction and
        # rollouts generated one step ahead must still leave the OPD signal exactly 0
        ["algorithm.rollout_correction.rollout_is=token", "async_training.enable=true"],
        [
            "model.use_remove_padding=true",
            "actor.use_dynamic_bsz=true",
            "actor.ppo_max_token_len_per_gpu=80",
            "actor.log_prob_max_token_len_per_gpu=80",
            "distill.teacher.log_prob_max_token_len_per_gpu=80",
        ],
        # a LoRA student starts as its base (adapters' B = 0), which is the teacher here
        ["model.lora_rank=4", "model.lora_alpha=8"],
    ],
    ids=["plain", "rollout-correction-ahead", "packed-dynamic", "lora-student"],
)
def test_a_teacher_equal_to_the_student_changes_nothing(tiny_model_dir, tmp_path, extra):
    """A = teacher - student = 0 on every token, so the policy loss's gradient is exactly 0 and AdamW moves no
    weight (no weight decay, no entropy or KL term): the final model is the initial one, bit for bit. The teacher
    pass is micro-batched as the old-log-prob pass (5 samples): other micro-batches round differently in fp32
    (~1e-9), and Adam turns even such a gradient into lr-sized steps."""
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        "algorithm.adv_estimator=opd",
        f"distill.teacher.path={tiny_model_dir}",
        "distill.teacher.log_prob_micro_batch_size_per_gpu=5",
        "distill.top_k=100",
        *extra,
    )
    run_training(cfg, quiet=True)
    if "model.lora_rank=4" in extra:  # the export is the adapter: its B matrices are still exactly 0
        adapter = load_file(tmp_path / "run" / "final_model" / "adapter_model.safetensors")
        lora_b = [v for k, v in adapter.items() if "lora_B" in k]
        assert lora_b and all(not v.any() for v in lora_b)
    else:
        start = _weights(load_causal_lm(tiny_model_dir))
        final = _weights(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model"))
        assert all(torch.equal(start[n], final[n]) for n in start), [
            n for n in start if not torch.equal(start[n], final[n])
        ]
    for m in read_metrics(tmp_path / "run"):
        assert m["distill/reverse_kl"] == 0.0 and m["distill/advantage_mean"] == 0.0
        assert m["distill/top_k_overlap"] > 0.0
        assert m["actor/grad_norm"] == 0.0


@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm.adv_estimator=opd", "distill.top_k=100"],
        ["algorithm.adv_estimator=grpo", "distill.opd_coef=0.5"],
    ],
    ids=["opd", "grpo+opd"],
)
def test_a_different_teacher_trains_the_student(tiny_model_dir, teacher_model_dir, tmp_path, extra):
    cfg = small_config(tiny_model_dir, tmp_path / "run", f"distill.teacher.path={teacher_model_dir}", *extra)
    run_training(cfg, quiet=True)
    start = _weights(load_causal_lm(tiny_model_dir))
    final = _weights(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model"))
    assert all(not torch.equal(start[n], final[n]) for n in start)
    metrics = read_metrics(tmp_path / "run")
    weight = 1.0 if "opd" in extra[0] else 0.5
    for m in metrics:
        assert m["distill/reverse_kl"] != 0.0
        assert m["distill/advantage_mean"] == pytest.approx(-weight * m["distill/reverse_kl"])
        assert m["distill/teacher_logprob"] < 0.0
        assert "timing/teacher" in m
    assert ("distill/top_k_overlap" in metrics[0]) == ("distill.top_k=100" in extra)


VOCAB_PROMPTS = [[5, 9, 3], [7, 4, 10, 6], [8, 2], [11, 12, 13, 14, 15]]
RESPONSES = [[20, 21, 22, 23, 24], [30, 31, 32], [40, 41, 42, 43], [50, 51]]


def _batch():
    batch = build_rollout_batch(VOCAB_PROMPTS, RESPONSES, [0, 0, 1, 1], pad_token_id=0)
    return batch


def test_environment_tokens_get_no_advantage_and_no_gradient(tiny_model_dir, teacher_model_dir):
    """Columns 1-2 of the first response are an environment's tokens (mask 0): the teacher's opinion of them
    is never a signal, and the OPD loss sends no gradient to the logits that predict them."""
    student, teacher = load_causal_lm(tiny_model_dir), load_causal_lm(teacher_model_dir)
    batch = _batch()
    batch.response_mask[0, 1:3] = 0.0
    with torch.no_grad():
        batch.old_log_probs, _ = policy_logprobs(student, batch)
    batch.teacher_log_probs = teacher_scores(
        teacher, batch, temperature=1.0, top_k=0, options=ForwardOptions()
    )
    mask = batch.response_mask
    inputs = AdvantageInputs(
        torch.zeros_like(mask),
        mask,
        teacher_log_probs=batch.teacher_log_probs,
        student_log_probs=batch.old_log_probs,
    )
    batch.advantages, _ = get_advantage_estimator("opd")(inputs)
    assert torch.equal(batch.advantages[0, 1:3], torch.zeros(2))
    assert bool((batch.advantages[mask > 0] != 0).all())
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["logits"] = output

    handle = student.lm_head.register_forward_hook(keep)
    loss, _ = actor_loss_fn(student, ActorConfig(), temperature=1.0)(
        batch, LossNormalizer(float(mask.sum()), float((mask.sum(-1) > 0).sum()), float(mask.shape[1]))
    )
    loss.backward()
    handle.remove()
    grad = captured["logits"].grad  # [B x R, V]: the head runs on the positions that predict response tokens
    per_token = grad.abs().sum(-1).view(batch.num_rows, batch.response_width)
    assert torch.equal(per_token[0, 1:3], torch.zeros(2))
    assert bool((per_token[mask > 0] > 0).all())


LAYOUTS = {  # name -> (options, micro-batch size, token budget)
    "padded-1": (ForwardOptions(), 1, None),
    "padded-all": (ForwardOptions(), 4, None),
    "packed-2": (ForwardOptions(remove_padding=True, max_row_tokens=12), 2, None),
    "packed-budget": (ForwardOptions(remove_padding=True, max_row_tokens=12), None, 10),
    "grouped": (ForwardOptions(prefix_grouper=True), 4, None),
    # distill.teacher.logprob_chunk_size: the head 3 tokens at a time (chunks that split rows), padded and packed
    "chunked-3": (ForwardOptions(logprob_chunk_size=3), 4, None),
    "packed-chunked-5": (
        ForwardOptions(remove_padding=True, max_row_tokens=12, logprob_chunk_size=5),
        2,
        None,
    ),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("top_k", [0, 100])
def test_the_teacher_pass_is_the_same_in_every_layout(teacher_model_dir, layout, top_k):
    """Packing, micro-batch sizes, token budgets and prompt grouping change how the teacher pass runs, never
    its log-probs (fp32-close) or its top-k membership; 0 where no response token is."""
    from posttrain.forward.shared_prefix import register_shared_prefix_attention

    batch = _batch()
    options, micro, budget = LAYOUTS[layout]
    attn = register_shared_prefix_attention() if options.prefix_grouper else "sdpa"
    teacher = load_causal_lm(teacher_model_dir, attn_implementation=attn)
    reference = load_causal_lm(teacher_model_dir)

    def run(model, opts, m, b):
        fn = lambda mb: teacher_scores(model, mb, temperature=0.7, top_k=top_k, options=opts)  # noqa: E731
        return forward_in_micro_batches(fn, batch, m, b, torch.device("cpu"))

    expected, got = run(reference, ForwardOptions(), 4, None), run(teacher, options, micro, budget)
    mask = batch.response_mask > 0
    logp = got[..., 0] if top_k else got
    expected_logp = expected[..., 0] if top_k else expected
    assert_fp32_close(logp[mask], expected_logp[mask], msg=layout)
    if top_k:
        assert torch.equal(got[..., 1][mask], expected[..., 1][mask])
        assert float(expected[..., 1][mask].sum()) > 0
    with torch.no_grad():
        student_logp, _ = policy_logprobs(reference, batch, temperature=0.7)
    assert torch.equal(expected_logp[mask], student_logp[mask])  # the same numbers as the policy's own pass


CONFIG_ERRORS = {
    "opd-without-teacher": (["algorithm.adv_estimator=opd"], "distill.teacher.path is empty"),
    "coef-without-teacher": (["distill.opd_coef=0.5"], "distill.opd_coef=0.5 needs a teacher"),
    "coef-with-opd": (
        ["algorithm.adv_estimator=opd", "distill.opd_coef=0.5", "TEACHER"],
        "already is that term",
    ),
    "unused-teacher": (["TEACHER"], "nothing uses the teacher"),
    "top-k-without-teacher": (["distill.top_k=3"], "distill.top_k=3"),
    "gkd-without-teacher": (["distill.gkd_coef=0.5"], "distill.gkd_coef=0.5 needs a teacher"),
    "gkd-lora": (["distill.gkd_coef=0.5", "TEACHER", "model.lora_rank=4"], "a LoRA student"),
    "missing-dir": (
        ["algorithm.adv_estimator=opd", "distill.teacher.path=/nonexistent/teacher"],
        "final_model",
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIG_ERRORS))
def test_what_cannot_work_is_a_config_error(tiny_model_dir, teacher_model_dir, tmp_path, name):
    extra, message = CONFIG_ERRORS[name]
    extra = [f"distill.teacher.path={teacher_model_dir}" if e == "TEACHER" else e for e in extra]
    with pytest.raises(ConfigError, match=message.replace(".", "\\.")):
        build_components(small_config(tiny_model_dir, tmp_path / "run", *extra), quiet=True)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_model_dir, tmp_path, monkeypatch):
    other = tmp_path / "other_teacher"
    shutil.copytree(tiny_model_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<tool_result>"])
    tok.save_pretrained(other)
    loaded = []
    monkeypatch.setattr("posttrain.rl.build.load_causal_lm", lambda *a, **k: loaded.append(a))
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", "algorithm.adv_estimator=opd", f"distill.teacher.path={other}"
    )
    with pytest.raises(ConfigError) as err:
        build_components(cfg, quiet=True)
    assert str(other) in str(err.value) and str(tiny_model_dir) in str(err.value)
    assert "vocabularies differ" in str(err.value)
    assert not loaded  # refused before any weights load


def test_a_run_directory_names_its_final_model(tiny_model_dir, teacher_model_dir, tmp_path):
    run = tmp_path / "teacher_run"
    shutil.copytree(teacher_model_dir, run / "final_model")
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", "algorithm.adv_estimator=opd", f"distill.teacher.path={run}"
    )
    components = build_components(cfg, quiet=True)
    try:
        expected = load_causal_lm(teacher_model_dir).state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in components.teacher.state_dict().items())
        assert not any(p.requires_grad for p in components.teacher.parameters())
    finally:
        components.close()


def test_the_memory_plan_counts_the_teacher(tiny_model_dir, teacher_model_dir, tmp_path):
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        "algorithm.adv_estimator=opd",
        f"distill.teacher.path={teacher_model_dir}",
        "distill.teacher.dtype=bf16",
        "distill.teacher.log_prob_micro_batch_size_per_gpu=2",
    )
    plan = build_plan(cfg)
    assert plan.teacher.micro_batch_size_per_rank == 2 and plan.old_log_prob_source == "recompute"
    shape = ModelShape.from_path(tiny_model_dir)
    estimate = estimate_memory(cfg, plan, shape)
    teacher_phase = estimate.phase("teacher")
    weights = {c.name: c.bytes for c in teacher_phase.components}
    assert weights["teacher weights"] == ModelShape.from_path(teacher_model_dir).num_params() * 2  # bf16
    assert "teacher weights" in {c.name for c in estimate.phase("actor_update").components}


def test_a_chunked_teacher_head_is_planned_smaller(tiny_model_dir, teacher_model_dir, tmp_path):
    """distill.teacher.logprob_chunk_size (or the reference's chunking, when unset) shrinks the teacher pass's
    planned work memory: its logits are one chunk's, not every token's (long responses: the head, not a decoder
    layer, is then the pass's largest step)."""
    base = [
        tiny_model_dir,
        tmp_path / "run",
        "algorithm.adv_estimator=opd",
        f"distill.teacher.path={teacher_model_dir}",
        "data.max_response_length=128",
    ]
    shape = ModelShape.from_path(tiny_model_dir)

    def teacher_peak(*extra):
        cfg = small_config(*base, *extra)
        return estimate_memory(cfg, build_plan(cfg), shape).phase("teacher").part("forward working memory")

    whole = teacher_peak()
    assert teacher_peak("distill.teacher.logprob_chunk_size=2") < whole
    chunked_ref = ["ref.entropy_from_logits_with_chunking=true", "ref.entropy_from_logits_chunk_size=2"]
    assert teacher_peak(*chunked_ref) < whole
    assert teacher_peak(*chunked_ref, "distill.teacher.logprob_chunk_size=0") == whole


def test_the_gkd_term_is_the_unchunked_jsd_of_the_models_logits(tiny_model_dir, teacher_model_dir):
    """The actor's loss with the GKD term (chunked, from hidden states) has the gradient of the plain loss plus
    coef x the token mean of :func:`generalized_jsd` over both models' full logits; environment tokens excluded."""
    section = DistillConfig(gkd_coef=0.7, gkd_beta=0.3, gkd_temperature=1.3, gkd_top_k=0, gkd_chunk_size=3)
    student, teacher = load_causal_lm(tiny_model_dir), load_causal_lm(teacher_model_dir)
    batch = _batch()
    batch.response_mask[0, 1:3] = 0.0
    mask = batch.response_mask
    with torch.no_grad():
        batch.old_log_probs, _ = policy_logprobs(student, batch)
    batch.advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    normalizer = LossNormalizer(float(mask.sum()), float((mask.sum(-1) > 0).sum()), float(mask.shape[1]))
    cfg = ActorConfig()

    def grads(loss):
        student.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in student.parameters()]

    loss, metrics = actor_loss_fn(student, cfg, 1.0, gkd=TeacherTerm(teacher, ForwardOptions(), section))(
        batch, normalizer
    )
    got = grads(loss)
    plain, _ = actor_loss_fn(student, cfg, 1.0)(batch, normalizer)
    p, r = batch.prompt_width, batch.response_width

    def logits(model):
        out = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        )
        return out.logits[:, p - 1 : p - 1 + r]

    with torch.no_grad():
        teacher_logits = logits(teacher)
    jsd = generalized_jsd(
        logits(student).flatten(0, 1), teacher_logits.flatten(0, 1), beta=0.3, temperature=1.3
    ).view(mask.shape)
    expected = grads(plain + 0.7 * (jsd * mask).sum() / mask.sum())
    assert_grads_equal(got, expected, "GKD term")
    assert metrics["actor/gkd_loss"] == pytest.approx(float((jsd * mask).sum() / mask.sum()), rel=1e-5)


@pytest.mark.parametrize("teacher", ["same", "other"])
def test_grpo_with_a_gkd_term_trains(tiny_model_dir, teacher_model_dir, tmp_path, teacher):
    path = tiny_model_dir if teacher == "same" else teacher_model_dir
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        f"distill.teacher.path={path}",
        "distill.gkd_coef=0.5",
        "distill.gkd_top_k=20",
        "actor.ppo_mini_batch_size=4",  # one optimizer step per step: step 1 sees the initial weights only
    )
    run_training(cfg, quiet=True)
    for m in read_metrics(tmp_path / "run"):
        if teacher == "same" and m["step"] == 1:  # the same weights: the divergence is float rounding only
            assert abs(m["actor/gkd_loss"]) < 1e-6
        else:  # another model, or the student once GRPO has moved it
            assert m["actor/gkd_loss"] > 1e-4
        assert "distill/reverse_kl" in m
