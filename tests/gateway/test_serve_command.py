"""`posttrain serve MODEL_DIR`: the real command in a subprocess, called with the real openai client, stopped by
SIGTERM; and each refused input (exit code 2, one message, before any weights load)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
import torch

from posttrain.cli import main
from posttrain.models.hf import load_causal_lm
from tests.gateway.support import client_for

REPO = Path(__file__).resolve().parents[2]
KEY = "serve-test-key-0123456789"
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class Served:
    def __init__(self, proc: subprocess.Popen, banner: str) -> None:
        self.proc, self.banner = proc, banner
        self.url = re.search(r"base URL: (\S+)", banner).group(1)
        self.key = re.search(r"export OPENAI_API_KEY=(\S+)", banner).group(1)


def start(model_dir: Path, *flags: str) -> Served:
    """`python -m posttrain serve` on a free port; returns once its start block is printed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "serve", str(model_dir), "--port", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    lines = []
    for line in proc.stdout:  # the block ends with the "Serving until" line
        lines.append(line)
        if line.startswith("Serving until"):
            return Served(proc, "".join(lines))
    proc.wait(timeout=30)
    raise AssertionError(
        f"serve exited {proc.returncode} before serving: {''.join(lines)}{proc.stderr.read()}"
    )


def stop(served: Served) -> float:
    """SIGTERM; the seconds it took to exit (asserts exit 0)."""
    begin = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    code = served.proc.wait(timeout=30)
    took = time.monotonic() - begin
    err = served.proc.stderr.read()
    assert code == 0, err
    assert "stopped" in err and "Traceback" not in err
    return took


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "key.txt"
    key_file.write_text(KEY + "\n")
    s = start(tiny_model_dir, "--api-key-file", str(key_file), "--model-name", "tiny-policy")
    yield s
    if s.proc.poll() is None:
        stop(s)


@pytest.fixture
def client(served):
    with client_for(served.url, KEY) as c:
        yield c


def test_the_start_block_says_how_to_point_a_client(served):
    assert served.url.startswith("http://127.0.0.1:") and served.url.endswith("/v1")
    assert f"export OPENAI_BASE_URL={served.url}" in served.banner
    assert (
        "export OPENAI_API_KEY=$(cat " in served.banner and KEY not in served.banner
    )  # never the file's key
    assert "model:    tiny-policy" in served.banner


def test_chat_with_a_tool_renders_it_into_the_prompt(client, tok):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.chat.completions.create(model="tiny-policy", messages=messages, max_tokens=4)
    with_tool = client.chat.completions.create(
        model="tiny-policy", messages=messages, tools=[TOOL], max_tokens=4, temperature=0
    )
    prompt = with_tool.model_extra["prompt_token_ids"]
    assert "lookup_weather" in tok.decode(prompt)
    assert len(prompt) > len(plain.model_extra["prompt_token_ids"])
    assert with_tool.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert with_tool.usage.completion_tokens == len(with_tool.choices[0].model_extra["token_ids"]) <= 4


def test_completions_honour_the_request_sampling(client):
    def sample(**kw):
        return client.completions.create(
            model="tiny-policy", prompt="Hello", **{"max_tokens": 6, **kw}
        ).choices[0]

    assert sample(temperature=0).model_extra["token_ids"] == sample(temperature=0).model_extra["token_ids"]
    seeded = sample(seed=7, temperature=1.5)
    assert seeded.model_extra["token_ids"] == sample(seed=7, temperature=1.5).model_extra["token_ids"]
    assert seeded.model_extra["token_ids"] != sample(seed=8, temperature=1.5).model_extra["token_ids"]
    assert len(sample(max_tokens=2).model_extra["token_ids"]) <= 2


def test_echo_scores_the_prompt_with_the_served_model(client, tiny_model_dir):
    """`posttrain serve` wires the loaded model to echo=true: a remote distillation teacher can use it."""
    ids = [5, 9, 3, 20, 21]
    r = client.completions.create(
        model="tiny-policy", prompt=ids, echo=True, logprobs=1, max_tokens=0, temperature=0.8
    )
    got = r.choices[0].logprobs.token_logprobs
    model = load_causal_lm(tiny_model_dir).float().eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float() / 0.8
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    assert got[0] is None
    torch.testing.assert_close(torch.tensor(got[1:]), expected, atol=1e-5, rtol=0)


def test_a_prompt_over_the_context_is_refused_400_naming_it(client, tiny_model_dir):
    context = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-policy", prompt=[5] * context, max_tokens=2)
    assert info.value.code == "context_length_exceeded"
    assert f"prompt: the prompt is {context} tokens; the model's context is {context} tokens" in str(
        info.value
    )


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list()] == ["tiny-policy"]


def test_a_call_without_the_key_is_refused_401(served):
    with client_for(served.url, "wrong-key") as c, pytest.raises(openai.AuthenticationError) as info:
        c.models.list()
    assert info.value.status_code == 401


def test_sigterm_stops_it_promptly_with_exit_0(tiny_model_dir):
    s = start(tiny_model_dir)  # no key file: a random key, printed once
    assert re.fullmatch(r"[A-Za-z0-9_-]{20,}", s.key)
    with client_for(s.url, s.key) as c:
        assert c.models.list().data[0].id == tiny_model_dir.name
    assert stop(s) < 10
    with pytest.raises(OSError):  # nothing listens any more
        socket.create_connection(("127.0.0.1", urlsplit(s.url).port), timeout=2).close()


@pytest.fixture
def no_template_dir(tiny_model_dir, tmp_path):
    out = tmp_path / "base"
    shutil.copytree(tiny_model_dir, out, ignore=shutil.ignore_patterns("chat_template.jinja"))
    return out


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def refusal(capsys, *args: str) -> str:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_refuses_a_missing_model_dir(capsys, tmp_path):
    assert "does not exist" in refusal(capsys, str(tmp_path / "nope"))


def test_refuses_a_directory_that_is_not_a_model(capsys, tmp_path):
    assert "is not a model directory: it has no config.json" in refusal(capsys, str(tmp_path))


def test_refuses_a_tokenizer_without_a_chat_template(capsys, no_template_dir):
    assert "has no tokenizer with a chat template" in refusal(capsys, str(no_template_dir))


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_refuses_a_bad_port(capsys, tiny_model_dir, port):
    assert f"--port {port}: a TCP port is 0 to 65535" in refusal(capsys, str(tiny_model_dir), "--port", port)


def test_refuses_a_port_in_use_and_warns_off_loopback(capsys, tiny_model_dir, taken_port):
    err = refusal(capsys, str(tiny_model_dir), "--host", "0.0.0.0", "--port", str(taken_port))
    assert (
        "warning: --host 0.0.0.0 is not a loopback address: the endpoint is reachable from the network" in err
    )
    assert f"cannot listen on --host 0.0.0.0 --port {taken_port}" in err


def test_refuses_an_unreadable_or_empty_key_file(capsys, tiny_model_dir, tmp_path):
    missing = tmp_path / "missing.txt"
    assert f"--api-key-file {missing}: cannot read it" in refusal(
        capsys, str(tiny_model_dir), "--api-key-file", str(missing)
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert f"--api-key-file {empty}: the file is empty" in refusal(
        capsys, str(tiny_model_dir), "--api-key-file", str(empty)
    )


def test_refuses_a_non_positive_request_size(capsys, tiny_model_dir):
    err = refusal(capsys, str(tiny_model_dir), "--max-request-bytes", "0")
    assert "--max-request-bytes 0: must be at least 1" in err
