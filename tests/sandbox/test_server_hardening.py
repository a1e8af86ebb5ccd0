"""`posttrain sandbox serve` against hostile clients, over real HTTP on loopback with the real bubblewrap sandbox:
each attack a review reproduced (negative length, held partial requests, a hung-up client's run, huge `files`,
bad file names, deep JSON, garbage headers, no authentication) gets a JSON answer and leaves the server up."""

import base64
import select
import tempfile
import threading
import time

import pytest

from posttrain.cli import main
from posttrain.config.errors import ConfigError
from posttrain.config.schema.sandbox import SandboxConfig
from posttrain.sandbox import Limits, LocalSandbox, RunRequest
from posttrain.sandbox.build import build_sandbox
from posttrain.sandbox.server import MAX_BODY_BYTES, is_loopback
from posttrain.sandbox.types import MAX_DIRECTORIES, MAX_FILES
from posttrain.sandbox.wire import MAX_FILES_BYTES
from tests.sandbox.http_raw import connect, exchange, post, read_answer, request_bytes, running
from tests.sandbox_support import TIGHT, child_pids, sandbox_pids

TIMEOUT_S = 1.0  # the test servers' request timeout
OK = {"code": "print(1)", "language": "python"}


@pytest.fixture(scope="module")
def served(sandbox):
    with running(sandbox, request_timeout_s=TIMEOUT_S, max_connections=16) as server:
        yield server


def assert_refused(answer, status, fragment):
    assert answer.status == status, answer
    assert answer.body["status"] == "SandboxError" and fragment in answer.body["message"], answer.body


@pytest.mark.parametrize(
    ("length", "status", "fragment"),
    [
        ("-1", 400, "one whole number"),
        ("-300000000", 400, "one whole number"),
        ("abc", 400, "one whole number"),
        ("+5", 400, "one whole number"),
        ("1e3", 400, "one whole number"),
        (None, 411, "Content-Length"),
        (str(MAX_BODY_BYTES + 1), 413, f"at most {MAX_BODY_BYTES}"),
    ],
)
def test_a_bad_content_length_is_answered(served, length, status, fragment):
    answer = exchange(served, request_bytes(b"{}", {"Content-Length": length}), timeout=10)
    assert_refused(answer, status, fragment)
    assert answer.headers["connection"] == "close"


def test_chunked_bodies_and_two_lengths_are_refused(served):
    chunked = request_bytes(b"2\r\n{}\r\n0\r\n\r\n", {"Content-Length": None, "Transfer-Encoding": "chunked"})
    assert_refused(exchange(served, chunked), 411, "no chunked encoding")
    twice = request_bytes(b"{}").replace(
        b"Content-Length: 2\r\n", b"Content-Length: 2\r\nContent-Length: 9\r\n"
    )
    assert_refused(exchange(served, twice), 400, "one whole number")


def test_a_body_shorter_than_its_length_is_answered(served):
    answer = exchange(served, request_bytes(b'{"code"', {"Content-Length": "50"}), half_close=True)
    assert_refused(answer, 400, "the body ended after 7 of 50 bytes")


def test_a_partial_request_is_answered_408_at_the_deadline_while_others_are_served(served):
    partial = connect(served, timeout=10)
    partial.sendall(request_bytes(b'{"code": "print(1)"', {"Content-Length": "100"}))
    idle = connect(served, timeout=10)
    trickle = connect(served, timeout=10)
    start = time.monotonic()
    assert post(served, OK).body["run_result"]["stdout"] == "1\n"  # served while three connections wait
    for byte in (
        b"POST /run_code HTTP/1.1\r\n" * 4
    ):  # one byte each 0.1 s: each read is quick, the whole is not
        if select.select([trickle], [], [], 0)[0]:
            break
        trickle.sendall(bytes([byte]))
        time.sleep(0.1)
    assert_refused(read_answer(trickle), 408, f"within {TIMEOUT_S:g} s")
    assert_refused(read_answer(partial), 408, "did not arrive in full")
    assert idle.recv(1) == b""  # an idle connection is closed without an answer (no request to answer)
    assert time.monotonic() - start < TIMEOUT_S + 2.5
    for sock in (partial, idle, trickle):
        sock.close()


def test_connections_beyond_the_cap_get_503(sandbox):
    with running(sandbox, max_connections=2, request_timeout_s=3.0) as server:
        held = [connect(server) for _ in range(2)]
        for sock in held:
            sock.sendall(b"POST /run_code HTTP/1.1\r\n")
        time.sleep(0.3)  # both accepted and waiting for the rest of their requests
        answer = post(server, OK)
        assert_refused(answer, 503, "2 connections at once already")
        assert answer.headers["retry-after"] == "1"
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 5
        while (answer := post(server, OK)).status == 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert answer.status == 200, answer


def test_a_client_that_hangs_up_cancels_its_run(tmp_path, monkeypatch):
    """One slot; the first client's program sleeps 25 s, and it hangs up: the second client waits for neither."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with running(LocalSandbox(Limits(time_limit_s=30.0, memory_limit_mb=256)), max_concurrent=1) as server:
        gone = connect(server)
        gone.sendall(request_bytes({"code": "import time; time.sleep(25)", "language": "python"}))
        deadline = time.monotonic() + 10
        while not list(tmp_path.glob("posttrain-sandbox-*")) and time.monotonic() < deadline:
            time.sleep(0.05)  # the run has started: its directory exists
        time.sleep(0.3)
        gone.close()
        start = time.monotonic()
        answer = post(server, OK)
        waited = time.monotonic() - start
    assert answer.body["run_result"]["stdout"] == "1\n"
    assert waited < 3.0, f"the next request waited {waited:.1f} s for a cancelled run"
    assert not sandbox_pids() and not child_pids()
    assert not list(tmp_path.glob("posttrain-sandbox-*"))


def test_a_cancelled_run_reports_why():
    cancel = threading.Event()
    box = LocalSandbox(Limits(time_limit_s=20.0, memory_limit_mb=256))
    threading.Timer(0.5, cancel.set).start()
    start = time.monotonic()
    result = box.run(RunRequest("import time; time.sleep(15)"), cancel=cancel)
    assert (result.status, result.stderr) == ("sandbox_error", "cancelled: the client went away")
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        ({"": "eA=="}, "empty, '.' and '..'"),
        ({".": "eA=="}, "empty, '.' and '..'"),
        ({"..": "eA=="}, "empty, '.' and '..'"),
        ({"a/../../etc/x": "eA=="}, "empty, '.' and '..'"),
        ({"a//b": "eA=="}, "empty, '.' and '..'"),
        ({"a/": "eA=="}, "empty, '.' and '..'"),
        ({"/etc/passwd": "eA=="}, "an absolute file name"),
        ({"a\x00b": "eA=="}, "NUL byte"),
        ({"x" * 300: "eA=="}, "a path component of 300 bytes; at most 255"),
        ({"/".join(["d" * 200] * 6): "eA=="}, "at most 1024"),
        ({"d/" * 16 + "f": "eA=="}, "17 path components; at most 16"),
        ({"\ud800": "eA=="}, "lone surrogate"),
        ({"main.py": "eA=="}, "the program's own file"),
        ({"main.py/x": "eA=="}, "the program's own file"),
        ({"a": "eA==", "a/b": "eA=="}, "is a file, and 'a/b' needs it to be a directory"),
        ({"f": "not base64!"}, "not base64"),
        ({"f": "é"}, "not base64"),
        ({"f": 3}, "must be a base64 string"),
        (["f"], "must map file names"),
    ],
)
def test_a_bad_file_is_refused_with_422(served, files, fragment):
    answer = post(served, {**OK, "files": files})
    assert_refused(answer, 422, fragment)
    assert answer.body["detail"][0]["loc"][:2] == ["body", "files"]


def test_the_files_caps(served):
    many = {f"f{i}": "" for i in range(MAX_FILES + 1)}
    assert_refused(post(served, {**OK, "files": many}), 422, f"{MAX_FILES + 1} entries; at most {MAX_FILES}")
    deep = {f"d{i}/" * 15 + "f": "" for i in range(MAX_DIRECTORIES // 15 + 1)}  # 75 directories
    assert_refused(post(served, {**OK, "files": deep}), 422, f"75 directories; at most {MAX_DIRECTORIES}")
    half = base64.b64encode(b"x" * (MAX_FILES_BYTES // 2 + 1)).decode()
    assert_refused(post(served, {**OK, "files": {"a": half, "b": half}}), 422, "decoded in all")
    skipped = {"f": None, "d/g": base64.b64encode(b"kept").decode()}  # SandboxFusion skips a null content
    answer = post(served, {**OK, "code": "print(open('d/g').read())", "files": skipped})
    assert answer.body["run_result"]["stdout"] == "kept\n"


def test_the_largest_accepted_files_stage_quickly(sandbox):
    """The worst `files` the caps allow: MAX_FILES entries needing MAX_DIRECTORIES directories (4 chains 15
    deep, 4 more), one of nearly MAX_FILES_BYTES (a /tmp of 64 MiB holds them); staged, run and removed within a
    few seconds."""
    files = {"/".join([f"d{i}"] * 15) + "/f": "eA==" for i in range(4)}
    files.update({f"e{i}/f": "eA==" for i in range(MAX_DIRECTORIES - 60)})
    files.update({f"f{i}": "eA==" for i in range(MAX_FILES - len(files) - 1)})
    files["big"] = base64.b64encode(b"x" * (MAX_FILES_BYTES - MAX_FILES)).decode()
    start = time.monotonic()
    with running(LocalSandbox(Limits(time_limit_s=10.0, memory_limit_mb=256, max_disk_mb=64))) as served:
        answer = post(served, {**OK, "code": "import os; print(len(os.listdir('.')))", "files": files})
    assert answer.body["run_result"]["stdout"] == f"{MAX_FILES + 1}\n", answer.body  # 8 directories, main.py
    assert time.monotonic() - start < 15


def test_files_larger_than_the_runs_tmp_are_refused(served):
    big = base64.b64encode(b"x" * (17 << 20)).decode()  # the fixture's /tmp holds 16 MiB
    answer = post(served, {**OK, "files": {"big": big}})
    assert answer.status in (400, 422), answer
    assert "sandbox.max_disk_mb=16" in answer.body["message"], answer.body


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b'{"code": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"a":' * 50_000 + b"}" * 50_000,
    ],
    ids=["open-lists", "a-closed-list-as-code", "objects"],
)
def test_deeply_nested_json_is_a_400(served, body):
    assert_refused(exchange(served, request_bytes(body)), 400, "nested too deeply")


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"\xff\xfe\x00garbage", 400, "not JSON"),
        (b"", 400, "not JSON"),
        (b"[]", 422, "a /run_code request is a JSON object"),
        ({"code": "print(1)"}, 422, "language: required: a string"),
        ({"language": "python"}, 422, "code: required: a string"),
        ({"code": 1, "language": "python"}, 422, "code: must be a string"),
        ({**OK, "language": "cpp"}, 422, "unsupported language 'cpp'"),
        ({**OK, "stdin": 5}, 422, "stdin: must be a string"),
        ({**OK, "run_timeout": -1}, 422, "run_timeout: must be a positive number"),
        ({**OK, "memory_limit_MB": 1.5}, 422, "whole number of MiB"),
        ({**OK, "memory_limit_MB": True}, 422, "whole number of MiB"),
        ({**OK, "fetch_files": ["out.txt"]}, 422, "not supported by this server"),
        ({**OK, "code": "\udc80"}, 422, "lone surrogate"),
    ],
)
def test_a_malformed_body_is_answered(served, body, status, fragment):
    assert_refused(post(served, body), status, fragment)


def test_validation_errors_have_fastapis_shape(served):
    answer = post(served, {"code": "print(1)"})
    assert answer.status == 422
    assert answer.body["detail"] == [
        {"type": "value_error", "loc": ["body", "language"], "msg": "required: a string"}
    ]


def test_memory_limit_minus_one_is_no_limit_of_the_requests_own(served):
    """SandboxFusion's default -1: the request sets no limit; the server's (256 MiB) still holds."""
    answer = post(served, {**OK, "memory_limit_MB": -1, "code": "print(1)"})
    assert answer.body["run_result"]["stdout"] == "1\n"
    big = post(served, {**OK, "memory_limit_MB": -1, "code": "x = bytearray(400 * 2**20)"})
    assert big.body["run_result"]["sandbox_status"] == "memory_limit", big.body


def test_output_over_the_cap_comes_back_cut_with_the_run_failed(served):
    answer = post(served, {**OK, "code": "print('x' * 10**6)"})
    assert (answer.body["status"], answer.body["message"]) == ("Failed", "output_truncated")
    run = answer.body["run_result"]
    assert len(run["stdout"]) == TIGHT.max_output_bytes and run["return_code"] is None


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"PUT /run_code HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 501),
        (b"POST /run_code HTTP/9.9\r\n\r\n", 505),
        (b"POST /" + b"x" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"POST /run_code HTTP/1.1\r\n" + b"X: y\r\n" * 120 + b"\r\n", 431),
        (b"POST /elsewhere HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 404),
    ],
)
def test_http_level_refusals_are_json(served, data, status):
    answer = exchange(served, data, half_close=True)
    assert answer.status == status and answer.body["status"] == "SandboxError", answer


class _Broken:
    """A backend with a bug: the server must answer 500 and stay up."""

    name, limits, own_pid_namespace = "broken", TIGHT, False

    def run(self, request, cancel=None):
        raise RuntimeError("a bug in a backend")

    def describe(self):
        return "broken"


def test_an_unexpected_exception_is_a_500_with_a_logged_traceback(caplog):
    with running(_Broken()) as server:
        with caplog.at_level("ERROR", logger="posttrain.sandbox"):
            assert_refused(post(server, OK), 500, "internal error")
        assert "a bug in a backend" in caplog.text and "Traceback" in caplog.text
        assert exchange(server, b"GET /health HTTP/1.1\r\n\r\n").status == 200


TOKEN = "s3cret-token-of-32-characters-ok"


def test_the_token_is_required_and_checked(sandbox, monkeypatch):
    with running(sandbox, token=TOKEN) as server:
        assert_refused(post(server, OK), 401, "Authorization: Bearer")
        assert post(server, OK).headers["www-authenticate"] == "Bearer"
        assert_refused(post(server, OK, {"Authorization": f"Bearer {TOKEN}x"}), 401, "Bearer")
        assert_refused(post(server, OK, {"Authorization": "Bearer \xe9\xff"}), 401, "Bearer")
        assert exchange(server, b"GET /health HTTP/1.1\r\n\r\n").status == 401
        assert post(server, OK, {"Authorization": f"Bearer {TOKEN}"}).body["run_result"]["stdout"] == "1\n"

        cfg = SandboxConfig(backend="sandbox_fusion")
        cfg.sandbox_fusion.url = [server.url]
        cfg.sandbox_fusion.token_env = "POSTTRAIN_TEST_SANDBOX_TOKEN"
        monkeypatch.setenv("POSTTRAIN_TEST_SANDBOX_TOKEN", TOKEN)
        assert build_sandbox(cfg).run(RunRequest("print(2)")).stdout == "2\n"
        monkeypatch.setenv("POSTTRAIN_TEST_SANDBOX_TOKEN", "wrong-token-of-enough-chars")
        refused = build_sandbox(cfg).run(RunRequest("print(2)"))
        assert refused.status == "sandbox_error" and "HTTP 401" in refused.stderr  # not retried
        monkeypatch.delenv("POSTTRAIN_TEST_SANDBOX_TOKEN")
        with pytest.raises(
            ConfigError, match="sandbox.sandbox_fusion.token_env='POSTTRAIN_TEST_SANDBOX_TOKEN'"
        ):
            build_sandbox(cfg)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        # addresses no interface here has, so that even a regression could not listen beyond loopback
        (["--host", "192.0.2.1"], "--host '192.0.2.1' is not a loopback address"),
        (["--host", "sandbox.example.invalid"], "pass --token-file PATH"),
        (["--token-file", "/nonexistent/token"], "--token-file /nonexistent/token: cannot read it"),
        (["--max-connections", "0"], "--max-connections 0: at least 1"),
        (["--request-timeout-s", "0"], "--request-timeout-s 0.0: must be positive"),
    ],
)
def test_the_cli_refuses_unsafe_or_broken_settings_before_serving(flags, fragment, capsys):
    assert main(["sandbox", "serve", "--port", "1", *flags]) == 2
    assert fragment in capsys.readouterr().err


def test_which_hosts_are_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "", "::", "10.0.0.5", "cpu1", "localhost.example.org"]))


def test_a_short_token_file_is_refused(tmp_path, capsys):
    path = tmp_path / "token"
    path.write_text("short\n")
    assert main(["sandbox", "serve", "--token-file", str(path), "--port", "1"]) == 2
    assert "at least 16 printable ASCII characters" in capsys.readouterr().err


def test_keep_alive_requests_on_one_connection(served):
    with connect(served) as sock:
        for i in range(3):
            sock.sendall(request_bytes({**OK, "code": f"print({i})"}))
            assert read_answer(sock).body["run_result"]["stdout"] == f"{i}\n"
