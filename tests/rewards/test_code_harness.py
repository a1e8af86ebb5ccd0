"""The code reward's harness (many cases in one sandbox run, a forked process each) against the plain way (one
sandbox run per case, the program as `python main.py`): every case must get the same status and the same
verdict, for well-behaved and for ill-behaved programs. And the expected outputs never enter the sandbox."""

import json

import pytest

from posttrain.rewards.code import COUNTS, CodeReward, expected_digests
from posttrain.rewards.code_harness import text_digest
from posttrain.sandbox import Limits, LocalSandbox
from posttrain.sandbox.build import Sandbox
from posttrain.sandbox.types import FINISHED, RunRequest
from tests.sandbox_support import sandbox_pids

LIMITS = Limits(
    time_limit_s=1.5, memory_limit_mb=256, max_processes=16, max_file_size_mb=1, max_output_bytes=65536
)
SUM = {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]}
READ = "a, b = map(int, input().split())\n"

STDIN_PROGRAMS = {
    "right": READ + "print(a + b)",
    "wrong on one": READ + "print(a + b if a else 99)",
    "wrong": READ + "print(a - b)",
    "stdin buffer": "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a + b)",
    "open(0)": "a, b = map(int, open(0).read().split())\nprint(a + b)",
    "main guard": "def main():\n    " + READ + "    print(a + b)\nif __name__ == '__main__':\n    main()",
    "argv": "import sys\n" + READ + "print(a + b if sys.argv == ['main.py'] else 'argv')",
    "stderr noise": "import sys\n" + READ + "print('noise', file=sys.stderr)\nprint(a + b)",
    "trailing spaces": READ + "print(a + b, end='   \\n\\n')",
    "exit 0 early": READ + "print(a + b)\nraise SystemExit(0)\nprint('never')",
    "exit 3": READ + "print(a + b)\nraise SystemExit(3)",
    "exit message": READ + "print(a + b)\nraise SystemExit('bye')",
    "exception": READ + "raise ValueError(a)",
    "read past eof": READ + "input()\nprint(a + b)",
    "os._exit loses buffer": "import os\n" + READ + "print(a + b)\nos._exit(0)",
    "non-daemon thread": "import threading, time\n"
    + READ
    + "threading.Thread(target=lambda: (time.sleep(0.05), print(a + b))).start()",
    "atexit": "import atexit\n" + READ + "atexit.register(lambda: print(a + b))",
    "fork": "import os\n" + READ + "pid = os.fork()\nif pid == 0:\n    print(a + b)\nelse:\n    os.wait()",
    "slow on one": "import time\n" + READ + "time.sleep(5 if a == 10 else 0)\nprint(a + b)",
    "memory hog": READ + "x = bytearray(10**10)\nprint(a + b)",
    "huge output": READ + "print('x' * 200_000)",
    "cpu spin": "while True:\n    pass",
    "leaves a process": "import os, time\n" + READ + "if os.fork() == 0:\n    os.setsid()\n"
    "    time.sleep(60)\nprint(a + b)",
}
ADD = {"fn_name": "add", "inputs": [[1, 2], "[10, -3]", [0, 0]], "outputs": [3, [7], [0]]}
CALL_PROGRAMS = {
    "right": "def add(a, b):\n    return a + b",
    "solution class": "class Solution:\n    def add(self, a, b):\n        return a + b if a > 1 else -1",
    "float and bool": "def add(a, b):\n    return float(a + b) if a else False",
    "tuple": "def add(a, b):\n    return (a + b,)",
    "raises": "def add(a, b):\n    raise KeyError(a)",
    "prints and returns": "def add(a, b):\n    print('hello')\n    return a + b",
    "not json": "def add(a, b):\n    return {a, b}",
}


@pytest.fixture(scope="module")
def box(sandbox):
    return Sandbox(LocalSandbox(LIMITS), max_concurrent=2)


def one_run_per_case(box, code, cases):
    """The plain way: each case its own sandbox run of the program; (status, passed) per case."""
    wants = expected_digests(cases)
    out = []
    for stdin, ok in zip(cases["inputs"], wants, strict=True):
        result = box.run(RunRequest(code, stdin=stdin))
        out.append((result.status, result.status == FINISHED and text_digest(result.stdout) in ok))
    return out


def through_the_harness(box, code, cases):
    run = CodeReward(box)._run(code, cases, cases["inputs"])
    wants = expected_digests(cases)
    return [(s, s == FINISHED and d in ok) for s, d, ok in zip(run.statuses, run.digests, wants, strict=True)]


@pytest.mark.parametrize("name", list(STDIN_PROGRAMS))
def test_each_case_ends_as_it_would_in_a_run_of_its_own(box, name):
    before = set(sandbox_pids())
    code = STDIN_PROGRAMS[name]
    assert through_the_harness(box, code, SUM) == one_run_per_case(box, code, SUM)
    assert set(sandbox_pids()) <= before  # nothing a case started is left running


def test_the_verdicts_the_plain_way_gives(box):
    """The comparison above is not vacuous: the programs end in every status."""
    statuses = {s for code in STDIN_PROGRAMS.values() for s, _ in one_run_per_case(box, code, SUM)}
    assert statuses == {"finished", "error", "time_limit", "memory_limit", "output_truncated"}


@pytest.mark.parametrize("name", list(CALL_PROGRAMS))
def test_call_based_cases_judge_the_returned_value_as_before(box, name):
    reward = CodeReward(box)
    expected = {
        "right": 1.0,
        "solution class": 1 / 3,
        "float and bool": 1.0,  # 3.0 == 3, [7.0] == [7] and False == 0, as Python's == has it
        "tuple": 2 / 3,  # (3,) is [3]: right where the expected value is written [7] or [0], not 3
        "raises": 0.0,
        "prints and returns": 1.0,
        "not json": 0.0,
    }[name]
    assert reward("", CALL_PROGRAMS[name], json.dumps(ADD), {}) == pytest.approx(expected)


def test_every_case_has_its_own_time_limit_in_one_run(box):
    """Three cases of 0.6 s each with a 1.5 s limit: 1.8 s in one run, all pass."""
    code = "import time\n" + READ + "time.sleep(0.6)\nprint(a + b)"
    assert CodeReward(box)("", code, json.dumps(SUM), {}) == 1.0


class Counting:
    """The local sandbox, counting its runs."""

    def __init__(self, backend):
        self.backend, self.name, self.limits, self.runs = backend, backend.name, backend.limits, 0
        self.own_pid_namespace = backend.own_pid_namespace

    def run(self, request):
        self.runs += 1
        return self.backend.run(request)

    def describe(self):
        return self.backend.describe()


def test_after_a_time_limit_the_cases_left_run_in_parallel(sandbox):
    """A program that loops: its first run stops at the first case's time limit, and the two cases left get a
    run each, at once (2 slots), as one run per case would have had them; in order, the slow case too."""
    counting = Counting(LocalSandbox(Limits(time_limit_s=1.0)))
    box = Sandbox(counting, max_concurrent=2)
    run = CodeReward(box)._run("while True:\n    pass", SUM, SUM["inputs"])
    assert run.statuses == ["time_limit"] * 3 and counting.runs == 3
    counting.runs = 0
    run = CodeReward(box)._run(STDIN_PROGRAMS["slow on one"], SUM, SUM["inputs"])
    assert run.statuses == ["finished", "time_limit", "finished"] and counting.runs == 2


def test_many_cases_are_split_over_runs_and_a_compile_error_runs_once(box):
    cases = {"inputs": [f"{i} {i}\n" for i in range(7)], "outputs": [f"{2 * i}\n" for i in range(7)]}
    reward = CodeReward(box, cases_per_run=3)
    assert reward("", READ + "print(a + b if a != 5 else 0)", json.dumps(cases), {}) == pytest.approx(6 / 7)
    before = COUNTS.copy()
    assert reward("", "print(1", json.dumps(cases), {}) == 0.0
    assert (COUNTS["compile_errors"] - before["compile_errors"], COUNTS["cases"] - before["cases"]) == (1, 1)


CHEAT = """\
import gc, json, os, sys
mine = sys.stdin.read()
found = []
for name in os.listdir("."):
    try:
        found.append(json.load(open(name)))
    except Exception:
        pass
found += [o for o in gc.get_objects() if isinstance(o, dict) and "outputs" in o]
for cases in found:
    if isinstance(cases, dict) and "outputs" in cases and mine in cases["inputs"]:
        print(cases["outputs"][cases["inputs"].index(mine)], end="")
        break
"""


def test_a_program_cannot_find_the_expected_outputs(box):
    """The cheat reads every file beside it and every dict in its process. Handed the cases as a file (as a
    harness that compared inside the sandbox would be), it passes; under the code reward it finds nothing."""
    with_answers = [
        box.run(RunRequest(CHEAT, stdin=i, files={"cases.json": json.dumps(SUM).encode()}))
        for i in SUM["inputs"]
    ]
    assert [r.stdout for r in with_answers] == SUM["outputs"]
    assert CodeReward(box)("", CHEAT, json.dumps(SUM), {}) == 0.0


CALL_CHEAT = """\
import sys

def add(a, b):
    frame = sys._getframe(1)
    while frame:
        for scope in (frame.f_locals, frame.f_globals):
            for value in list(scope.values()):
                if isinstance(value, dict) and "output" in value:  # what one run per case used to hand in
                    return value["output"]
        frame = frame.f_back
"""


def test_a_function_cannot_find_its_expected_value_in_its_callers(box):
    assert CodeReward(box)("", CALL_CHEAT, json.dumps(ADD), {}) == 0.0


def test_a_program_that_kills_the_harness_scores_zero(box):
    code = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"
    before = COUNTS.copy()
    assert CodeReward(box)("", code, json.dumps(SUM), {}) == 0.0
    assert COUNTS["cases"] - before["cases"] == 3


LEAVES_A_SLEEPER = """\
import os, time
a, b = map(int, input().split())
if os.path.exists("sleeper"):  # a case before this one left a process
    pid = int(open("sleeper").read())
    alive = os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
    print("left running" if alive else a + b)
else:
    if os.fork() == 0:
        os.setsid()
        open("sleeper", "w").write(str(os.getpid()))
        time.sleep(60)
    time.sleep(0.2)
    print(a + b)
"""


def test_what_a_case_leaves_outside_its_group_is_killed_before_the_next(box):
    """In the local sandbox (a PID namespace of its own) the harness kills every process but itself after each
    case, so a later case of the same program finds nothing running: all three pass."""
    assert CodeReward(box)("", LEAVES_A_SLEEPER, json.dumps(SUM), {}) == 1.0


def test_only_a_report_with_the_runs_nonce_that_fits_is_trusted():
    from posttrain.rewards.code import read_harness
    from posttrain.rewards.code_harness import REPORT_MARKER
    from posttrain.sandbox.types import RunResult

    case = {"returncode": 0, "timed_out": False, "truncated": False, "stderr": "", "digest": "d"}
    late = {**case, "returncode": -9, "timed_out": True}

    def report(cases, nonce="n0nce", status="finished"):
        line = REPORT_MARKER + nonce + " " + json.dumps({"compile_error": None, "cases": cases})
        return read_harness(RunResult(status, 0, "\n\n" + line + "\n", "", 0.1), 2, "n0nce").statuses

    assert report([case, case]) == ["finished", "finished"]
    assert report([late]) == ["time_limit"]  # the harness stops after a time limit: the host runs the rest
    refused = ["sandbox_error", "sandbox_error"]
    assert report([case] * 5) == refused  # more cases than the run held
    assert report([case]) == refused  # fewer, without a time limit
    assert report([]) == refused  # the empty forged report that raised IndexError
    assert report([case, case], nonce="guess") == refused
    assert report([case, case], status="error") == refused  # the harness itself failed
    for stdout in [REPORT_MARKER + "n0nce {not json", REPORT_MARKER + 'n0nce {"cases": 3}', "no report"]:
        run = read_harness(RunResult("finished", 0, stdout, "", 0.1), 2, "n0nce")
        assert run.statuses == refused and run.compile_error is None
    killed = read_harness(RunResult("time_limit", None, "", "", 9.0), 2, "n0nce")
    assert killed.statuses == ["time_limit", "time_limit"]


FORGER = r"""
import ctypes, json, os
harness = os.getppid()
nonce = ""
for fd in range(3, 32):  # the nonce file the harness keeps open
    try:
        nonce = nonce or open(f"/proc/{harness}/fd/{fd}").read().strip()
    except (OSError, UnicodeDecodeError):
        pass
case = {"returncode": 0, "timed_out": False, "truncated": False, "stderr": "", "digest": "x"}
report = json.dumps({"compile_error": None, "cases": [case]})
line = "\nFORGED\n__posttrain_code_harness_report__ " + nonce + " " + report + "\n"
try:
    with open(f"/proc/{harness}/fd/1", "w") as f:
        f.write(line)
except OSError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
stolen = libc.syscall(438, os.pidfd_open(harness), 1, 0)  # pidfd_getfd: the harness's stdout
if stolen >= 0:
    os.write(stolen, line.encode())
"""


def test_a_case_cannot_reach_the_harnesss_report(box):
    """The harness is not dumpable and pidfd_getfd is filtered: a case can neither open the harness's stdout
    through /proc nor take it with pidfd_getfd, so no forged line reaches the run's output."""
    from posttrain.rewards.code import harness_request

    request = harness_request(FORGER, SUM, SUM["inputs"][:1], LIMITS, "n0nce", own_pid_namespace=True)
    result = box.run(request)
    assert result.status == "finished" and "FORGED" not in result.stdout, result
    assert CodeReward(box)("", FORGER, json.dumps(SUM), {}) == 0.0


def test_a_stopped_harness_ends_at_one_cases_limit_not_the_whole_runs(box):
    """A case that SIGSTOPs its harness: the host stops the run once the harness has been silent for one
    case's limit (1.5 s here, plus the harness's start allowance), not after 16 x 1.5 s + 2 s."""
    import time

    code = "import os, signal, time\nos.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(100)"
    cases = {"inputs": [f"{i} {i}\n" for i in range(16)], "outputs": [f"{2 * i}\n" for i in range(16)]}
    start = time.monotonic()
    assert CodeReward(box)("", code, json.dumps(cases), {}) == 0.0
    assert time.monotonic() - start < 8.0
    assert sandbox_pids() == []


def test_a_small_output_cap_puts_fewer_cases_in_a_run(sandbox):
    """Each case's report takes up to 1 KB of the run's output: a 2.5 KB cap holds 2 cases a run."""
    counting = Counting(LocalSandbox(Limits(time_limit_s=5.0, max_output_bytes=2500)))
    cases = {"inputs": [f"{i} {i}\n" for i in range(5)], "outputs": [f"{2 * i}\n" for i in range(5)]}
    assert CodeReward(Sandbox(counting, 2))("", READ + "print(a + b)", json.dumps(cases), {}) == 1.0
    assert counting.runs == 3


def test_cases_per_run_below_one_is_a_config_error_naming_the_key():
    from posttrain.config.errors import ConfigError
    from posttrain.config.load import build_config

    with pytest.raises(ConfigError, match=r"'sandbox\.code_reward\.cases_per_run' = 0 must be >= 1"):
        build_config(overrides=["sandbox.code_reward.cases_per_run=0"])
    assert (
        build_config(overrides=["sandbox.code_reward.cases_per_run=1"]).sandbox.code_reward.cases_per_run == 1
    )


@pytest.mark.parametrize(
    ("returns", "expected", "score"),
    [
        ("'123'", "123", 1.0),  # a string expected value stays a string (it was parsed as JSON: 0.0)
        ("123", "123", 0.0),
        ("'true'", "true", 1.0),
        ("True", "true", 0.0),
        ("123", 123, 1.0),
        ("123.0", 123, 1.0),  # == as APPS compares: 123.0 == 123
        ("(1, 2)", [1, 2], 1.0),  # a tuple counts as a list
        ("[1, 2]", [[1, 2]], 1.0),  # the expected value wrapped in a list
        ("'a'", ["a", "b"], 1.0),  # APPS: a non-empty expected list's first element passes too
        ("[1, 2]", "[1, 2]", 0.0),  # a JSON text is a string, not the list it spells
    ],
)
def test_call_based_values_compare_as_apps_checker_does(box, returns, expected, score):
    cases = {"fn_name": "f", "inputs": [[0]], "outputs": [expected]}
    assert CodeReward(box)("", f"def f(x):\n    return {returns}", json.dumps(cases), {}) == score
