"""The SandboxFusion client against `posttrain sandbox serve`, over real HTTP on loopback."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config.errors import ConfigError
from posttrain.config.schema.sandbox import SandboxConfig
from posttrain.planning.sandbox_probe import harness_probe_line
from posttrain.sandbox import Limits, RunRequest
from posttrain.sandbox.build import Sandbox, build_sandbox
from posttrain.sandbox.fusion import FusionSandbox
from posttrain.sandbox.server import SandboxServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(sandbox):
    server = SandboxServer(("127.0.0.1", 0), Sandbox(sandbox, max_concurrent=2))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


CODE_DATA = Path(__file__).parents[2] / "examples/code/tiny_code.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_client_runs_code_on_the_server(served):
    client = FusionSandbox([served.url], Limits(time_limit_s=5))
    r = client.run(RunRequest("import sys; print(input() * 2); sys.exit(3)", stdin="ab\n", files={"f": b"x"}))
    assert (r.status, r.exit_code, r.stdout) == ("error", 3, "abab\n")
    assert client.run(RunRequest("print(open('f').read())", files={"f": b"xyz"})).stdout == "xyz\n"


def test_the_wire_format_is_sandbox_fusions(served):
    body = {
        "code": "print(1)",
        "language": "python",
        "compile_timeout": 10,
        "run_timeout": 3,
        "memory_limit_MB": 128,
        "stdin": "",
        "files": {},
    }
    req = urllib.request.Request(
        served.url + "/run_code", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as answer:
        out = json.loads(answer.read())
    assert out["status"] == "Success"
    run = out["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 0, "1\n", "")
    assert run["execution_time"] > 0


def test_a_time_limit_over_http(served):
    r = FusionSandbox([served.url], Limits(time_limit_s=1)).run(RunRequest("while True: pass"))
    assert r.status == "time_limit", r


def test_a_malformed_request_is_a_422_not_retried(served):
    client = FusionSandbox([served.url], max_retries=3)
    r = client.run(RunRequest("print(1)", files={"../x": b""}))
    assert r.status == "sandbox_error" and "HTTP 422" in r.stderr and "files['../x']: " in r.stderr


def test_round_robin_skips_a_dead_url_and_retries(served):
    dead = f"http://127.0.0.1:{free_port()}"
    client = FusionSandbox([dead, served.url], Limits(time_limit_s=5), max_retries=2)
    results = [client.run(RunRequest("print('ok')")) for _ in range(4)]
    assert all(r.stdout == "ok\n" for r in results), results


class _Flaky(BaseHTTPRequestHandler):
    """Answers 503 twice, then hangs once past the client's timeout, then forwards to the real server."""

    calls = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        _Flaky.calls.append(time.monotonic())
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if len(_Flaky.calls) <= 2:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if len(_Flaky.calls) == 3:
            time.sleep(3)
            return
        req = urllib.request.Request(
            self.server.target, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as answer:
            body = answer.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_5xx_and_timeouts_are_retried(served):
    flaky = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    flaky.daemon_threads = True
    flaky.target = served.url + "/run_code"
    threading.Thread(target=flaky.serve_forever, daemon=True).start()
    try:
        client = FusionSandbox(
            [f"http://127.0.0.1:{flaky.server_address[1]}"],
            Limits(time_limit_s=1),
            request_timeout_s=0.5,
            max_retries=3,
        )
        r = client.run(RunRequest("print('third time lucky')"))
    finally:
        flaky.shutdown()
        flaky.server_close()
    assert r.stdout == "third time lucky\n", r
    assert len(_Flaky.calls) == 4


def test_the_cli_server_and_a_killed_server(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "posttrain.cli",
            "sandbox",
            "serve",
            "--port",
            str(port),
            "sandbox.time_limit_s=5",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        banner = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/run_code" in banner, banner
        client = FusionSandbox([f"http://127.0.0.1:{port}"], Limits(time_limit_s=5), max_retries=1)
        assert client.run(RunRequest("echo hi", language="bash")).stdout == "hi\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        r = client.run(RunRequest("print(1)"))
        assert r.status == "sandbox_error" and "no answer after 2 tries" in r.stderr, r
    finally:
        proc.kill()
        proc.wait()


def test_verls_keys_and_a_missing_url(served):
    cfg = SandboxConfig(backend="sandbox_fusion", max_concurrent=3, memory_limit_mb=300)
    with pytest.raises(ConfigError, match="sandbox.sandbox_fusion.url"):
        build_sandbox(cfg)
    cfg.sandbox_fusion.url = [served.url]
    box = build_sandbox(cfg)
    assert box.max_concurrent == 3 and box.limits.memory_limit_mb == 300
    results = box.run_many([RunRequest(f"print({i})") for i in range(5)])
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
    box.close()


def test_explain_shows_the_sandbox_and_when_the_code_reward_scores(sandbox, capsys):
    code = [
        "reward.function=code",
        f"data.train_files=[{CODE_DATA}]",
        "model.path=builtin:base",
        "trainer.device=cpu",
    ]
    assert main(["explain", *code]) == 0
    out = capsys.readouterr().out
    assert "probe: print(6 * 7) -> 42" in out
    assert "scoring: after generation (auto: the rollout runs on cpu" in out  # this CPU rollout
    assert main(["explain", *code, "reward.score_during_generation=always"]) == 0
    assert "scoring: during generation (reward.score_during_generation=always" in capsys.readouterr().out


def test_the_explain_probe_line_and_a_sandbox_that_cannot_run():
    line = harness_probe_line(SandboxConfig(time_limit_s=5))
    assert line.startswith("sandbox: local bubblewrap") and "probe: print(6 * 7) -> 42" in line
    dead = SandboxConfig(backend="sandbox_fusion")
    dead.sandbox_fusion.url = [f"http://127.0.0.1:{free_port()}"]
    dead.sandbox_fusion.max_retries = 0
    with pytest.raises(
        ConfigError, match="cannot run the code reward's harness on a trivial program: status"
    ):
        harness_probe_line(dead)


def test_the_probe_line_is_one_line_whatever_the_bwrap_paths_length(sandbox, tmp_path, capsys):
    """rich wrapped the line at 120 columns where the path's length put the break (for a bwrap under a venv
    in /home it split "probe: print(6 * 7)") and read "[sandbox]" in a path as markup."""
    for name in ["b", "a-longer-directory-name-" * 3 + "[sandbox]"]:
        link = tmp_path / name / "bwrap"
        link.parent.mkdir()
        link.symlink_to(sandbox.bwrap)
        code = ["reward.function=code", f"data.train_files=[{CODE_DATA}]", "model.path=builtin:base"]
        assert main(["explain", *code, "trainer.device=cpu", f"sandbox.bwrap_path={link}"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sandbox: "))
        assert f"({link};" in line and "probe: print(6 * 7) -> 42 in" in line, line
