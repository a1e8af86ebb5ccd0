"""Running one harness: the callable (sync, async) and the command forms, their results, and every failure kind
with its message; loading a harness names the key on a missing file, function or program."""

import asyncio
import pickle
import signal
import sys
import time

import pytest

from posttrain.config.errors import ConfigError
from posttrain.config.schema.harness import HarnessConfig
from posttrain.gateway.harness import (
    CallableHarness,
    CommandHarness,
    HarnessFailure,
    HarnessResult,
    load_harness,
    parse_result,
    run_harness,
)

ROW = {"prompt": "2+2?", "ground_truth": "4"}


def run(harness, timeout=10.0):
    return asyncio.run(run_harness(harness, ROW, "http://127.0.0.1:1/s/x/v1", "KEY", timeout, where="row 3"))


def failure(harness, kind, timeout=10.0):
    with pytest.raises(HarnessFailure) as e:
        run(harness, timeout)
    assert e.value.kind == kind
    return str(e.value)


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, HarnessResult()),
        (1, HarnessResult(1.0)),
        (0.5, HarnessResult(0.5)),
        ({"reward": 2.0, "metrics": {"steps": 3}}, HarnessResult(2.0, {"steps": 3.0})),
        ({"metrics": {"steps": 1}}, HarnessResult(None, {"steps": 1.0})),
    ],
)
def test_result_forms(value, expected):
    assert parse_result(value, "h") == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("1.0", "returned the reward '1.0': a reward is a finite number"),
        (True, "returned the reward True"),
        (float("nan"), "returned the reward nan"),
        ({"reward": 1, "score": 2}, r"keys \['score'\]: only \['reward', 'metrics'\] are read"),
        ({"metrics": [1]}, "metrics is a dict of name -> number"),
        ({"metrics": {"x": "high"}}, "reported the metric 'x' = 'high'"),
    ],
)
def test_bad_results_are_bad_output(value, message):
    with pytest.raises(HarnessFailure, match=message) as e:
        parse_result(value, "h")
    assert e.value.kind == "bad_output"


def test_a_sync_callable_gets_the_row_and_its_session():
    seen = {}

    def fn(row, base_url, api_key):
        seen.update(row=row, url=base_url, key=api_key)
        return {"reward": 1.0, "metrics": {"calls": 2}}

    assert run(CallableHarness(fn, "f")) == HarnessResult(1.0, {"calls": 2.0})
    assert seen == {"row": ROW, "url": "http://127.0.0.1:1/s/x/v1", "key": "KEY"}


def test_an_async_callable_is_awaited():
    async def fn(row, base_url, api_key):
        await asyncio.sleep(0)
        return 0.25

    assert run(CallableHarness(fn, "f")).reward == 0.25


def test_an_async_callable_that_installs_signal_handlers_does_not_keep_them():
    """An agent library may set SIGINT/SIGTERM handlers when it builds its environment (verifiers does): the run's
    own are back after the call, so a signal still stops the run as posttrain says (and an xdist worker stops)."""

    async def fn(row, base_url, api_key):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return 1.0

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert run(CallableHarness(fn, "f")).reward == 1.0
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_callable_failures():
    def boom(row, url, key):
        raise RuntimeError("no luck")

    async def slow(row, url, key):
        await asyncio.sleep(5)

    assert "harness 'f' on row 3 raised RuntimeError('no luck')" in failure(
        CallableHarness(boom, "f"), "raised"
    )
    took = time.monotonic()
    assert "took more than harness.timeout_s=0.2" in failure(CallableHarness(slow, "f"), "timeout", 0.2)
    assert time.monotonic() - took < 3


def command(code: str) -> CommandHarness:
    return CommandHarness((sys.executable, "-c", code), "cmd")


def test_a_command_gets_the_row_on_stdin_and_the_session_in_its_environment():
    code = (
        "import json, os, sys\n"
        "row = json.load(sys.stdin)\n"
        "print('log line')\n"
        "ok = os.environ['OPENAI_BASE_URL'].endswith('/s/x/v1') and os.environ['OPENAI_API_KEY'] == 'KEY'\n"
        "print(json.dumps({'reward': 1.0 if ok and row['ground_truth'] == '4' else 0.0}))\n"
    )
    assert run(command(code)) == HarnessResult(1.0)
    assert run(command("print('null')")) == HarnessResult()


def test_command_failures():
    assert "exited with status 3; its stderr ends: bad" in failure(
        command("import sys; sys.stderr.write('bad'); sys.exit(3)"), "exit"
    )
    assert "is not JSON" in failure(command("print('done!')"), "bad_output")
    assert "printed nothing" in failure(command("pass"), "bad_output")
    assert "only ['reward', 'metrics']" in failure(command("print('{\"score\": 1}')"), "bad_output")


def test_a_timed_out_command_loses_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "child"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    took = time.monotonic()
    failure(command(code), "timeout", 1.0)
    assert time.monotonic() - took < 10
    child = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is asynchronous; the child is re-parented and reaped
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_loading_names_the_key_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.py").write_text("def agent(row, base_url, api_key):\n    return None\n")
    assert load_harness(HarnessConfig(path="h.py:agent")).fn.__name__ == "agent"
    with pytest.raises(ConfigError, match="harness.path='nope.py:agent': file 'nope.py' not found"):
        load_harness(HarnessConfig(path="nope.py:agent"))
    with pytest.raises(ConfigError, match=r"harness.path='h.py:run': .* defines no 'run'; .*\['agent'\]"):
        load_harness(HarnessConfig(path="h.py:run"))
    with pytest.raises(ConfigError, match="expected 'path/to/file.py:function'"):
        load_harness(HarnessConfig(path="h.py"))
    assert load_harness(HarnessConfig(command=f"{sys.executable} agent.py")).argv[0] == sys.executable
    with pytest.raises(
        ConfigError, match="harness.command='no-such-program-x --a': program 'no-such-program-x'"
    ):
        load_harness(HarnessConfig(command="no-such-program-x --a"))
    with pytest.raises(ConfigError, match="cannot split it into arguments .* fix its quoting"):
        load_harness(HarnessConfig(command="python 'unclosed"))


def test_a_failure_pickles_with_its_kind():
    back = pickle.loads(pickle.dumps(HarnessFailure("timeout", "row 3 took too long")))
    assert back.kind == "timeout" and str(back) == "row 3 took too long"
