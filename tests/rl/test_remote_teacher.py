"""A remote distillation teacher (distill.teacher.base_url): posttrain's own gateway serving the tiny teacher
scores the student's samples exactly as the local teacher pass does, a 2-step OPD run with it logs the local
run's metrics, a server that is down, fails or hangs is retried and counted and then stops the run naming it,
and what cannot work is a ConfigError before any model loads."""

import json
import socket
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from posttrain.config.errors import ConfigError
from posttrain.config.plan import build_plan
from posttrain.config.schema.distill import TeacherConfig
from posttrain.data.batch import build_rollout_batch
from posttrain.forward.passes import ForwardOptions
from posttrain.forward.teacher import teacher_scores
from posttrain.gateway import Gateway
from posttrain.gateway.prompt_scores import PromptScorer
from posttrain.models.hf import load_causal_lm
from posttrain.planning.explain import plan_tree
from posttrain.planning.memory import estimate_memory
from posttrain.planning.shape import ModelShape
from posttrain.rl.build import build_components
from posttrain.rl.remote_teacher import RemoteTeacher, RemoteTeacherUnavailable
from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, small_config, small_overrides
from tests.rewards.judge_server import ScriptedJudge

PROMPTS = [[5, 9, 3], [7, 4, 10, 6], [8, 2], [11, 12, 13, 14, 15]]
RESPONSES = [[20, 21, 22, 23, 24], [30, 31, 32], [40, 41, 42, 43], [50, 51]]
KEY_ENV = "POSTTRAIN_TEST_TEACHER_KEY"


def no_generation(requests, params):
    raise RuntimeError("the teacher server only scores prompts in these tests")


@pytest.fixture(scope="module")
def teacher_model(teacher_model_dir):
    return load_causal_lm(teacher_model_dir).float().eval()


@pytest.fixture
def served(teacher_model, tok, monkeypatch):
    """The tiny teacher behind posttrain's gateway on loopback; its key in KEY_ENV."""
    with Gateway(no_generation, tok, model_name="teacher", prompt_scorer=PromptScorer(teacher_model)) as gw:
        monkeypatch.setenv(KEY_ENV, gw.api_key)
        yield gw


def remote(base_url, **keys):
    return RemoteTeacher(TeacherConfig(base_url=base_url, model="teacher", api_key_env=KEY_ENV, **keys))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_remote_log_probs_are_the_local_teacher_pass(served, teacher_model, temperature):
    batch = build_rollout_batch(PROMPTS, RESPONSES, [0, 0, 1, 1], pad_token_id=0)
    teacher = remote(served.base_url, max_concurrency=2)
    got = teacher.scores(batch, temperature)
    expected = teacher_scores(
        teacher_model, batch, temperature=temperature, top_k=0, options=ForwardOptions()
    )
    mask = batch.response_mask > 0
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)
    assert not got[~mask].any()  # pads: 0
    assert teacher.metrics() == {
        "distill/remote/requests": 4.0,
        "distill/remote/retries": 0.0,
        "distill/remote/failures": 0.0,
    }


def _comparable(metrics):
    """The metrics that do not measure time."""
    timed = ("timing/", "perf/", "distill/remote/")
    return {
        k: v for k, v in metrics.items() if not k.startswith(timed) and not k.endswith(("time_s", "wait_s"))
    }


def test_an_opd_run_with_the_remote_teacher_logs_the_local_runs_metrics(
    served, tiny_model_dir, teacher_model_dir, tmp_path
):
    local = small_config(
        tiny_model_dir,
        tmp_path / "local",
        "algorithm.adv_estimator=opd",
        f"distill.teacher.path={teacher_model_dir}",
    )
    remote_cfg = small_config(
        tiny_model_dir,
        tmp_path / "remote",
        "algorithm.adv_estimator=opd",
        f"distill.teacher.base_url={served.base_url}",
        "distill.teacher.model=teacher",
        f"distill.teacher.api_key_env={KEY_ENV}",
    )
    run_training(local, quiet=True)
    run_training(remote_cfg, quiet=True)
    local_metrics, remote_metrics = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "remote")
    assert len(local_metrics) == len(remote_metrics) == 2
    for a, b in zip(local_metrics, remote_metrics):
        assert b["distill/remote/requests"] == 16.0 and b["distill/remote/failures"] == 0.0
        assert "timing/teacher" in b
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert remote_metrics[0]["distill/reverse_kl"] != 0.0


@pytest.mark.dist
def test_two_ranks_ask_for_their_own_samples_and_train_like_one_local_rank(
    served, tiny_model_dir, teacher_model_dir, tmp_path
):
    """Each of 2 ranks sends its own share of the samples to the server: together the 16 requests of the 1-rank
    run, and the same metrics as a 1-rank run with the local teacher."""
    from tests.parallel.conftest import torchrun

    common = ["algorithm.adv_estimator=opd", "trainer.export_hf=false"]
    run_training(
        small_config(
            tiny_model_dir, tmp_path / "local", *common, f"distill.teacher.path={teacher_model_dir}"
        ),
        quiet=True,
    )
    remote_keys = [
        f"distill.teacher.base_url={served.base_url}",
        "distill.teacher.model=teacher",
        f"distill.teacher.api_key_env={KEY_ENV}",
    ]
    overrides = small_overrides(tiny_model_dir, tmp_path / "remote", *common, *remote_keys)
    torchrun(2, "train", tmp_path / "out", dict(o.split("=", 1) for o in overrides))
    local_metrics, remote_metrics = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "remote")
    assert len(local_metrics) == len(remote_metrics) == 2
    for a, b in zip(local_metrics, remote_metrics):
        assert b["distill/remote/requests"] == 16.0 and b["distill/remote/failures"] == 0.0
        a, b = _comparable(a), _comparable(b)
        for k in ("reward/mean", "actor/pg_loss", "distill/reverse_kl", "distill/teacher_logprob"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def _reply(request):
    """A completions reply echoing the request's token ids, each with log-prob -1."""
    ids = request["prompt"]
    body = {
        "choices": [
            {"index": 0, "text": "", "logprobs": {"token_logprobs": [None] + [-1.0] * (len(ids) - 1)}}
        ]
    }
    return 200, json.dumps(body).encode()


def _one_row():
    return build_rollout_batch([[5, 9]], [[20, 21, 22]], [0], pad_token_id=0)


def test_errors_and_garbage_are_retried_and_counted(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "k")
    answers = iter(
        [(500, b"{}"), (200, b"<html>"), (200, b'{"choices": [{"logprobs": {"token_logprobs": [1]}}]}')]
    )

    def flaky(request):
        return next(answers, None) or _reply(request)

    with ScriptedJudge(flaky) as server:
        teacher = remote(server.base_url, max_retries=3, backoff_s=0.0)
        got = teacher.scores(_one_row(), 1.0)
        sent = server.requests[-1]
    assert got.tolist() == [[-1.0, -1.0, -1.0]]
    assert teacher.metrics() == {
        "distill/remote/requests": 4.0,
        "distill/remote/retries": 3.0,
        "distill/remote/failures": 0.0,
    }
    assert sent["prompt"] == [5, 9, 20, 21, 22] and sent["echo"] is True and sent["max_tokens"] == 0
    assert server.auth[-1] == "Bearer k"


def test_a_failing_server_stops_the_run_naming_it(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "k")
    with ScriptedJudge(lambda request: (500, b"{}")) as server:
        teacher = remote(server.base_url, max_retries=2, backoff_s=0.0)
        with pytest.raises(RemoteTeacherUnavailable, match=r"127\.0\.0\.1:\d+/v1/completions.*HTTP 500"):
            teacher.scores(_one_row(), 1.0)
    assert teacher.http.requests == 3 and teacher.http.failures == 1


def test_a_hanging_server_times_out(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "k")
    with ScriptedJudge(_reply, delay_s=1.0) as server:
        teacher = remote(server.base_url, timeout_s=0.2, max_retries=1, backoff_s=0.0)
        with pytest.raises(RemoteTeacherUnavailable, match="timed out"):
            teacher.scores(_one_row(), 1.0)
    assert teacher.http.retries == 1


def test_a_down_server_stops_the_run_naming_it(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "k")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    teacher = remote(f"http://127.0.0.1:{port}/v1", max_retries=1, backoff_s=0.0)
    with pytest.raises(RemoteTeacherUnavailable, match=rf"127\.0\.0\.1:{port}/v1/completions.*refused"):
        teacher.scores(_one_row(), 1.0)


REMOTE = [
    "algorithm.adv_estimator=opd",
    "distill.teacher.base_url=http://127.0.0.1:9/v1",
    "distill.teacher.model=t",
]
CONFIG_ERRORS = {
    "both": (["distill.teacher.path=builtin:tiny"], "are both set"),
    "no-model": (["distill.teacher.model="], "distill.teacher.model is empty"),
    "not-a-url": (["distill.teacher.base_url=localhost:8000"], "must be an http"),
    "gkd": (["distill.gkd_coef=0.5"], "GKD needs the teacher's whole"),
    "top-k": (["distill.top_k=5"], "distill.top_k=5"),
    "missing-key": ([f"distill.teacher.api_key_env={KEY_ENV}_UNSET"], f"{KEY_ENV}_UNSET is not set"),
}


def test_the_memory_and_batch_plans_have_no_teacher_pass_here(tiny_model_dir, tmp_path):
    """No weights and no forward pass of a remote teacher on the trainer; the old log-probs are still
    recomputed before the advantages."""
    cfg = small_config(tiny_model_dir, tmp_path / "run", *REMOTE)
    plan = build_plan(cfg)
    assert plan.old_log_prob_source == "recompute"
    estimate = estimate_memory(cfg, plan, ModelShape.from_path(tiny_model_dir))
    names = {p.phase for p in estimate.phases}
    assert "teacher" not in names
    assert not any("teacher" in c.name for p in estimate.phases for c in p.components)
    console = Console(width=400, record=True)
    console.print(plan_tree(cfg, plan))
    text = console.export_text()
    assert "one request per sample, 8 at a time" in text and "distill.teacher.log_prob" not in text


@pytest.mark.parametrize("name", sorted(CONFIG_ERRORS))
def test_what_cannot_work_is_a_config_error(tiny_model_dir, tmp_path, monkeypatch, name):
    extra, message = CONFIG_ERRORS[name]
    monkeypatch.delenv(f"{KEY_ENV}_UNSET", raising=False)
    given = {e.split("=")[0] for e in extra}
    base = [r for r in REMOTE if r.split("=")[0] not in given]
    cfg = small_config(tiny_model_dir, tmp_path / "run", *base, *extra)
    with pytest.raises(ConfigError, match=message.replace(".", "\\.")):
        build_components(cfg, quiet=True)


def test_a_missing_key_variable_exits_2_through_the_cli(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(f"{KEY_ENV}_UNSET", raising=False)
    args = small_overrides(
        tiny_model_dir, tmp_path / "run", *REMOTE, f"distill.teacher.api_key_env={KEY_ENV}_UNSET"
    )
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "train", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert f"distill.teacher.api_key_env={KEY_ENV}_UNSET" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
