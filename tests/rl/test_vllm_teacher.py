"""A vLLM OpenAI-compatible server as the remote distillation teacher (distill.teacher.base_url): the prompt
log-probs it echoes for the student's token ids are the local teacher pass's at temperature 1, in fp32 on both
sides.

Runs in the vLLM environment only (``pytest -m vllm``): the real ``vllm.entrypoints.openai.api_server`` in a
subprocess on loopback, one CPU thread, eager mode.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from posttrain.config.schema.distill import TeacherConfig  # noqa: E402
from posttrain.data.batch import build_rollout_batch  # noqa: E402
from posttrain.forward.passes import ForwardOptions  # noqa: E402
from posttrain.forward.teacher import teacher_scores  # noqa: E402
from posttrain.models.hf import load_causal_lm  # noqa: E402
from posttrain.rl.remote_teacher import RemoteTeacher  # noqa: E402
from posttrain.rollout.vllm.knobs import CPU_BLOCK_TOKENS  # noqa: E402

PROMPTS = [[5, 9, 3], [7, 4, 10, 6], [8, 2], [11, 12, 13, 14, 15]]
RESPONSES = [[20, 21, 22, 23, 24], [30, 31, 32], [40, 41, 42, 43], [50, 51]]
KEY_ENV = "POSTTRAIN_TEST_VLLM_TEACHER_KEY"
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(vllm_model_dir, tmp_path_factory):
    """`vllm serve` of the tiny teacher (fp32, eager) on loopback, behind an API key; its base URL."""
    port, key = free_port(), "teacher-key"
    log = tmp_path_factory.mktemp("vllm-teacher") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_model_dir),
        "--served-model-name", "teacher", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--host", "127.0.0.1", "--port", str(port), "--api-key", key,
        # on CPU the KV cache is host memory: a small fixed size, not a share of the machine's
        "--kv-cache-memory-bytes", str(64 * 2**20), "--block-size", str(CPU_BLOCK_TOKENS),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_until_up(server, f"http://127.0.0.1:{port}/health", log)
        os.environ[KEY_ENV] = key
        yield base_url
    finally:
        os.environ.pop(KEY_ENV, None)
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_until_up(server, health_url, log):
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the vLLM server exited ({server.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(health_url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"the vLLM server did not answer in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_vllm_server_gives_the_local_teacher_log_probs_at_temperature_1(
    vllm_server, vllm_model_dir, temperature
):
    """vLLM's prompt log-probs come from the raw logits: the request's temperature is not applied to them (nor with
    ``--logprobs-mode processed_logprobs``, which concerns sampled tokens only). So they are the local teacher's at
    temperature 1 whatever the sampling temperature, as docs/distillation.md says."""
    batch = build_rollout_batch(PROMPTS, RESPONSES, [0, 0, 1, 1], pad_token_id=0)
    teacher = RemoteTeacher(TeacherConfig(base_url=vllm_server, model="teacher", api_key_env=KEY_ENV))
    got = teacher.scores(batch, temperature)
    model = load_causal_lm(vllm_model_dir).float().eval()
    expected = teacher_scores(model, batch, temperature=1.0, top_k=0, options=ForwardOptions())
    mask = batch.response_mask > 0
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)
    assert not got[~mask].any()
    assert teacher.metrics() == {
        "distill/remote/requests": 4.0,
        "distill/remote/retries": 0.0,
        "distill/remote/failures": 0.0,
    }
