"""A teacher per data_source (`distill.teachers`): each row is scored by its own source's teacher (log-probs
checked against a plain forward of that teacher), rows without a teacher get exactly the advantages of a
plain GRPO step, every teacher is counted in the metrics and the memory plan, and a bad mapping is a
ConfigError before any weights load."""

import json

import pytest
import torch

from posttrain.config.errors import ConfigError
from posttrain.config.plan import build_plan
from posttrain.data.batch import build_rollout_batch
from posttrain.data.records import PromptRecord
from posttrain.forward.options import pass_options
from posttrain.models.hf import load_causal_lm
from posttrain.parallel.data_parallel import DataParallel
from posttrain.planning.memory import estimate_memory
from posttrain.planning.shape import ModelShape
from posttrain.rl.build import build_components
from posttrain.rl.step import ForwardPasses, compute_advantages, fill_forward_passes
from posttrain.rl.teacher_routing import NO_TEACHER, check_route_sources, teacher_route
from posttrain.rl.train_command import run_training
from posttrain.utils.metrics import PhaseTimer
from tests.helpers import read_metrics, small_config

PROMPTS = [[5, 9, 3], [7, 4, 10, 6], [8, 2], [11, 12, 13, 14, 15]]
RESPONSES = [[20, 21, 22, 23, 24], [30, 31, 32], [40, 41, 42, 43], [50, 51]]


def _records(*sources):
    return [PromptRecord(f"q{i}", "1", {"data_source": s} if s else {}) for i, s in enumerate(sources)]


def test_rows_are_routed_by_data_source(tiny_model_dir, teacher_model_dir, tmp_path):
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", "distill.opd_coef=0.5", "distill.teachers={a: x, b: y}"
    )
    route = teacher_route(cfg, fallback_source="task")
    ids = route.row_ids(_records("b", "a", "c", None))
    assert ids.tolist() == [1, 0, NO_TEACHER, NO_TEACHER]  # c and a row without the field: no teacher
    cfg.distill.teacher.path = "z"
    route = teacher_route(cfg, fallback_source="task")
    assert route.names == ("a", "b", "default") and route.keys()[2] == "distill.teacher.path"
    assert route.row_ids(_records("b", "a", "c", None)).tolist() == [1, 0, 2, 2]
    check_route_sources(route, _records("a", "b"))
    with pytest.raises(ConfigError, match=r"distill.teachers.b='y': no training row has data_source 'b'"):
        check_route_sources(route, _records("a", "c"))


def _plain_logprobs(model, prompt, response):
    """log pi(response | prompt) by one unpadded forward and a log-softmax: the hand check."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def _step_parts(tiny_model_dir, tmp_path, *extra):
    cfg = small_config(tiny_model_dir, tmp_path / "run", *extra)
    dp = DataParallel()
    passes = ForwardPasses(
        build_plan(cfg),
        pass_options(cfg, torch.device("cpu")),
        {"old_log_prob": dp, "teacher": dp},
        torch.device("cpu"),
    )
    batch = build_rollout_batch(PROMPTS, RESPONSES, [0, 0, 1, 1], pad_token_id=0)
    batch.token_level_scores = torch.zeros_like(batch.response_mask)
    batch.token_level_scores[:, 1] = torch.tensor([1.0, 0.0, 0.5, 2.0])
    return cfg, passes, batch


@pytest.mark.parametrize("top_k", [0, 100])
def test_each_row_gets_its_own_teachers_log_probs(tiny_model_dir, teacher_model_dir, tmp_path, top_k):
    """Rows 0 and 3 go to teacher 0 (the other model), row 2 to teacher 1 (the student itself), row 1 to none:
    each teacher's numbers equal a plain forward of that teacher on that row alone; a row without a teacher
    gets the student's own log-probs (so its OPD advantage is exactly 0)."""
    student, other = load_causal_lm(tiny_model_dir), load_causal_lm(teacher_model_dir)
    cfg, passes, batch = _step_parts(
        tiny_model_dir, tmp_path, "distill.opd_coef=0.5", "distill.teachers={a: x}"
    )
    batch.teacher_ids = torch.tensor([0, NO_TEACHER, 1, 0])
    extra = fill_forward_passes(
        batch, student, None, None, passes, 1.0, PhaseTimer(), None, top_k, (other, student)
    )
    assert ("in_top_k" in extra) == bool(top_k)
    for row, model in ((0, other), (2, student), (3, other)):
        n = len(RESPONSES[row])
        assert torch.allclose(
            batch.teacher_log_probs[row, :n], _plain_logprobs(model, PROMPTS[row], RESPONSES[row]), atol=1e-5
        )
    assert torch.equal(batch.teacher_log_probs[1], batch.old_log_probs[1])


@pytest.mark.parametrize("estimator", ["grpo", "opd"])
def test_rows_without_a_teacher_keep_the_plain_grpo_advantages(
    tiny_model_dir, teacher_model_dir, tmp_path, estimator
):
    other, student = load_causal_lm(teacher_model_dir), load_causal_lm(tiny_model_dir)
    extra = ["distill.opd_coef=0.5"] if estimator == "grpo" else ["algorithm.adv_estimator=opd"]
    cfg, passes, batch = _step_parts(tiny_model_dir, tmp_path, *extra, "distill.teachers={a: x}")
    batch.teacher_ids = torch.tensor([0, NO_TEACHER, NO_TEACHER, 0])
    fill_forward_passes(batch, student, None, None, passes, 1.0, PhaseTimer(), None, 0, (other,))
    plain = batch.select(torch.arange(4))
    plain.teacher_log_probs = plain.teacher_ids = None
    cfg_plain = small_config(tiny_model_dir, tmp_path / "plain")
    compute_advantages(plain, cfg_plain.algorithm, None)
    metrics = compute_advantages(batch, cfg.algorithm, None, distill=cfg.distill)
    for row in (1, 2):  # no teacher: GRPO's advantages exactly (opd: exactly 0)
        want = plain.advantages[row] if estimator == "grpo" else torch.zeros_like(plain.advantages[row])
        assert torch.equal(batch.advantages[row], want)
    for row in (0, 3):
        assert not torch.equal(batch.advantages[row], plain.advantages[row])
    mask = batch.response_mask[[0, 3]]
    kl = ((batch.old_log_probs[[0, 3]] - batch.teacher_log_probs[[0, 3]]) * mask).sum() / mask.sum()
    assert metrics["distill/reverse_kl"] == pytest.approx(float(kl), rel=1e-5)  # teacher rows only


def _two_source_data(tmp_path):
    rows = [
        {"data_source": source, "prompt": f"What is {i} + 1?", "answer": str(i + 1)}
        for i in range(8)
        for source in ("alpha", "beta")
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_a_run_counts_each_teachers_rows(tiny_model_dir, teacher_model_dir, tmp_path):
    data = _two_source_data(tmp_path)
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        "distill.opd_coef=0.5",
        f"distill.teachers={{alpha: {teacher_model_dir}}}",
    )
    run_training(cfg, quiet=True)
    metrics = read_metrics(tmp_path / "run")
    for m in metrics:
        assert m["distill/rows/alpha"] + m["distill/rows/none"] == 16  # 4 prompts x 4 samples
        assert m["distill/rows/alpha"] % 4 == 0  # a prompt's samples share its source
        assert "timing/teacher" in m
    assert sum(m["distill/rows/alpha"] for m in metrics) > 0


def test_bad_mappings_are_config_errors(tiny_model_dir, teacher_model_dir, tmp_path, monkeypatch):
    data = _two_source_data(tmp_path)
    base = [f"data.train_files=[{data}]", f"data.val_files=[{data}]", "distill.opd_coef=0.5"]
    typo = small_config(
        tiny_model_dir, tmp_path / "a", *base, f"distill.teachers={{gamma: {teacher_model_dir}}}"
    )
    with pytest.raises(ConfigError, match="distill.teachers.gamma=.*no training row has data_source 'gamma'"):
        build_components(typo, quiet=True)
    missing = small_config(
        tiny_model_dir, tmp_path / "b", *base, f"distill.teachers={{alpha: {tmp_path / 'nope'}}}"
    )
    with pytest.raises(ConfigError, match="distill.teachers.alpha="):
        build_components(missing, quiet=True)
    gkd = small_config(
        tiny_model_dir, tmp_path / "c", *base, "distill.gkd_coef=1", "distill.teachers={alpha: x}"
    )
    with pytest.raises(ConfigError, match="GKD has one teacher"):
        build_components(gkd, quiet=True)


def test_the_memory_plan_counts_every_teacher(tiny_model_dir, teacher_model_dir, tmp_path):
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        "distill.opd_coef=0.5",
        f"distill.teacher.path={teacher_model_dir}",
        f"distill.teachers={{alpha: {teacher_model_dir}, beta: {tiny_model_dir}}}",
    )
    estimate = estimate_memory(cfg, build_plan(cfg), ModelShape.from_path(tiny_model_dir))
    names = {c.name: c.bytes for c in estimate.phase("teacher").components}
    n = ModelShape.from_path(teacher_model_dir).num_params() * 4  # fp32
    assert names["teacher weights"] == names["teacher weights (alpha)"] == n
    assert names["teacher weights (beta)"] == ModelShape.from_path(tiny_model_dir).num_params() * 4
