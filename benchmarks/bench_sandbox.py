"""Sandbox throughput: executions per second of a trivial Python program, and the sandbox's overhead.

Run::

    python3 benchmarks/bench_sandbox.py            # 40 runs per row
    python3 benchmarks/bench_sandbox.py --runs 100

Rows: a plain subprocess (``python3 main.py`` with the sandbox's environment, no limits: the floor), the same under the rlimits only
(``sandbox.unsafe_no_isolation=true``), and the bubblewrap sandbox run one at a time and with
``max_concurrent`` 2 and 8 (``Sandbox.run_many``); and ``echo`` in bash, plain and sandboxed, which shows the
sandbox's own cost apart from interpreter start-up. The overhead is a row's median latency minus the plain
subprocess's of the same language. (Python's start-up depends on the ``.pth`` files of its site-packages: a
file that imports from a directory the sandbox does not show fails fast inside, so Python may start faster
sandboxed than plain.) Rows alternate in rounds so that load from other jobs hits them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from posttrain.sandbox import Limits, LocalSandbox, RunRequest
from posttrain.sandbox.build import Sandbox
from posttrain.sandbox.bwrap import inside_env

PROGRAM = "print(sum(range(100)))"
PROGRAMS = {"python": PROGRAM, "bash": "echo 4950"}


def plain(n: int, language: str) -> list[float]:
    out = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "main")
        with open(path, "w") as f:
            f.write(PROGRAMS[language])
        env = {**inside_env(), "HOME": d, "TMPDIR": d}  # the sandbox's environment
        binary = os.path.realpath(sys.executable) if language == "python" else "/bin/bash"
        for _ in range(n):
            start = time.monotonic()
            subprocess.run([binary, path], capture_output=True, check=True, cwd=d, env=env)
            out.append(time.monotonic() - start)
    return out


def one_by_one(box: Sandbox, n: int, language: str = "python") -> list[float]:
    out = []
    for _ in range(n):
        start = time.monotonic()
        result = box.run(RunRequest(PROGRAMS[language], language=language))
        assert result.stdout == "4950\n", result
        out.append(time.monotonic() - start)
    return out


def batched(box: Sandbox, n: int) -> float:
    """Executions per second with ``box.max_concurrent`` at once."""
    start = time.monotonic()
    results = box.run_many([RunRequest(PROGRAM)] * n)
    assert all(r.stdout == "4950\n" for r in results)
    return n / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="executions per row and round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    limits = Limits(time_limit_s=10)
    local = LocalSandbox(limits)
    rows: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        rows.setdefault("bash: plain subprocess", []).extend(plain(args.runs, "bash"))
        rows.setdefault("bash: bwrap sandbox", []).extend(one_by_one(Sandbox(local, 1), args.runs, "bash"))
        rows.setdefault("plain subprocess", []).extend(plain(args.runs, "python"))
        rows.setdefault("rlimits only (unsafe)", []).extend(
            one_by_one(Sandbox(LocalSandbox(limits, unsafe_no_isolation=True), 1), args.runs)
        )
        rows.setdefault("bwrap sandbox", []).extend(one_by_one(Sandbox(local, 1), args.runs))
        for k in (2, 8):
            box = Sandbox(local, k)
            rates.setdefault(f"bwrap sandbox, max_concurrent {k}", []).append(batched(box, args.runs))
            box.close()
    floors = {
        True: statistics.median(rows["bash: plain subprocess"]),
        False: statistics.median(rows["plain subprocess"]),
    }
    print(f"{os.cpu_count()} CPUs; {args.rounds} rounds x {args.runs} runs of {PROGRAM!r}")
    print(f"{'variant':38} {'median ms':>10} {'p90 ms':>8} {'exec/s':>8} {'overhead ms':>12}")
    for name, times in rows.items():
        med = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        print(
            f"{name:38} {med * 1e3:10.1f} {p90 * 1e3:8.1f} {1 / med:8.1f} {(med - floors[name.startswith('bash')]) * 1e3:12.1f}"
        )
    for name, values in rates.items():
        print(f"{name:38} {'':>10} {'':>8} {statistics.median(values):8.1f}")


if __name__ == "__main__":
    main()
