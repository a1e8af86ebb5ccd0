"""Random requests against a real `posttrain sandbox serve` on 127.0.0.1 (the real bubblewrap sandbox, small
limits): random JSON, random bytes, random header values, wrong lengths and truncated bodies. Every request gets
an HTTP answer with a JSON body, the server stays up, and afterwards no sandbox process or directory is left."""

import json
import tempfile
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from posttrain.sandbox import Limits, LocalSandbox
from tests.sandbox.http_raw import exchange, post, running
from tests.sandbox_support import child_pids, sandbox_pids

SMALL = Limits(
    time_limit_s=1.0, memory_limit_mb=256, max_processes=16, max_file_size_mb=1, max_output_bytes=4096
)
TOKEN = "fuzz-token-0123456789abcdef"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
codes = st.sampled_from(
    [
        "print(1)",
        "",
        "import sys; sys.exit(3)",
        "print(input())",
        "print('x' * 10**5)",
        "echo hi",
        "import time",
    ]
) | st.text(max_size=30)
file_maps = st.dictionaries(
    st.text(max_size=12) | st.sampled_from(["a", "a/b", "../x", "/etc/x", ".", "main.py", "d/e"]),
    st.sampled_from(["eA==", "", "!!", None]) | json_values,
    max_size=3,
)
run_bodies = st.fixed_dictionaries(
    {
        "code": st.one_of(codes, codes, codes, json_values),
        "language": st.sampled_from(["python"] * 4 + ["bash"] * 2 + ["cpp", None, "json"]).flatmap(
            lambda v: json_values if v == "json" else st.just(v)
        ),
    },
    optional={
        "stdin": st.text(max_size=10) | json_values,
        "files": file_maps | json_values,
        "run_timeout": st.floats(-1, 3) | json_values,
        "memory_limit_MB": st.integers(-2, 300) | json_values,
        "fetch_files": st.lists(st.text(max_size=5), max_size=2),
    },
)
run_json = run_bodies.map(lambda b: json.dumps(b).encode())
bodies = st.one_of(
    run_json,
    run_json,
    run_json,
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300),
    st.integers(1, 20_000).map(lambda n: b"[" * n),
)
header_text = st.text(
    st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=40
)
header_names = st.sampled_from(
    ["Transfer-Encoding", "Expect", "Connection", "Content-Type", "Host"]
) | st.from_regex(r"X-[A-Za-z0-9-]{0,15}", fullmatch=True)
lengths = st.sampled_from(["exact"] * 8 + ["absent", "number", "text"])
authorizations = st.sampled_from(["token"] * 8 + ["none", "text"])


@st.composite
def requests(draw) -> tuple[bytes, bool]:
    """The raw request and whether the client ends its side after it (a body cut short)."""
    method = draw(st.sampled_from(["POST"] * 12 + ["GET", "PUT", "P0ST"]))
    path = draw(st.sampled_from(["/run_code"] * 10 + ["/v1/run_code", "/health", "/"]))
    body = draw(bodies)
    headers = [(name, draw(header_text).strip()) for name in draw(st.lists(header_names, max_size=2))]
    authorization = draw(authorizations)
    if authorization != "none":
        headers.append(
            ("Authorization", f"Bearer {TOKEN}" if authorization == "token" else draw(header_text))
        )
    length = draw(lengths)
    if length == "number":
        length = str(draw(st.integers(-5, 400)))
    elif length == "text":
        length = draw(header_text).strip()
    truncated = False
    if length == "exact":
        length = str(len(body))
    if length.isdigit() and int(length) < len(body):
        body = body[: int(length)]  # what lies beyond a length is the next request: not this test's subject
    elif length.isdigit() and int(length) > len(body):
        truncated = True
    if length != "absent":
        headers.append(("Content-Length", length))
    head = "".join(f"{name}: {value}\r\n" for name, value in headers)
    return f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode("latin-1") + body, truncated


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """A server with a token (most requests carry it) and short timeouts; its sandboxes' directories go to a
    temp dir of its own, so that leftovers are this server's."""
    try:
        backend = LocalSandbox(SMALL)
    except Exception as exc:  # noqa: BLE001 (the conftest's rule: no bwrap here, say why)
        pytest.skip(f"no working bwrap here: {exc}")
    tmp = tmp_path_factory.mktemp("fuzz-tmp")
    saved, tempfile.tempdir = tempfile.tempdir, str(tmp)
    try:
        with running(backend, token=TOKEN, request_timeout_s=1.0, max_connections=8) as server:
            yield server, tmp
    finally:
        tempfile.tempdir = saved


@settings(
    max_examples=200,
    deadline=10_000,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(request=requests())
def test_every_request_gets_a_json_answer(fuzzed, request):
    server, _ = fuzzed
    data, truncated = request
    answer = exchange(server, data, half_close=truncated, timeout=20)
    assert 200 <= answer.status < 600 and isinstance(answer.body, dict), answer
    event(f"HTTP {answer.status}")
    if answer.status == 200 and data.startswith(b"POST"):
        assert {"status", "run_result"} <= answer.body.keys(), answer.body


def test_after_the_fuzzing_the_server_is_up_and_nothing_is_left(fuzzed):
    server, tmp = fuzzed
    answer = post(server, {"code": "print(7)", "language": "python"}, {"Authorization": f"Bearer {TOKEN}"})
    assert answer.body["run_result"]["stdout"] == "7\n"
    deadline = time.monotonic() + 5  # a run whose client hung up may still be cleaning up
    while (sandbox_pids() or child_pids() or list(tmp.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sandbox_pids() and not child_pids()
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("posttrain-sandbox-")]
