"""How fast the command line answers: `posttrain --help`, a misspelled key and a misspelled reward function name
(config errors, exit 2).

Run::

    python3 benchmarks/cli_latency.py             # 7 timed runs of each, after one warm-up run
    python3 benchmarks/cli_latency.py --runs 15

Each run is a fresh `python3 -m posttrain` process of this checkout, timed from start to exit (interpreter start
included, as a user sees it); the median, fastest and slowest run of each command are printed with the load
average, so a number taken on a busy machine says so, and the median CPU time (user + system), which other jobs
on the machine change less than the wall time. The warm-up run lets Python write its bytecode cache, as an
installed package has it; with PYTHONDONTWRITEBYTECODE set (nothing cached), every run compiles the sources again
and the line says so.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REWARD = "def reward(prompt, response, ground_truth, extra):\n    return 1.0\n"


def commands(reward_file: Path) -> dict[str, tuple[list[str], int]]:
    """Each timed command: its arguments and the exit code it must end with."""
    return {
        "posttrain --help": (["--help"], 0),
        "posttrain train trainer.totl_steps=3 (a typo)": (["train", "trainer.totl_steps=3"], 2),
        "posttrain train reward.function=reward.py:rewrd": (
            ["train", f"reward.function={reward_file}:rewrd"],
            2,
        ),
    }


def run_once(args: list[str], expected_code: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one `python3 -m posttrain ARGS` process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "posttrain", *args], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != expected_code:
        raise SystemExit(
            f"posttrain {' '.join(args)} exited {done.returncode}, not {expected_code}:\n{done.stderr}"
        )
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="Timed runs per command (default 7)")
    args = parser.parse_args()
    cache = "off (PYTHONDONTWRITEBYTECODE)" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "on"
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; bytecode cache {cache}")
    folder = tempfile.TemporaryDirectory()
    reward_file = Path(folder.name) / "reward.py"
    reward_file.write_text(REWARD)
    for name, (cli_args, code) in commands(reward_file).items():
        run_once(cli_args, code)  # warm-up: bytecode written, files in the page cache
        runs = [run_once(cli_args, code) for _ in range(args.runs)]
        wall = sorted(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(
            f"{name:50s} median {statistics.median(wall):.3f} s  (fastest {wall[0]:.3f}, slowest {wall[-1]:.3f}, "
            f"{args.runs} runs; CPU time median {cpu:.3f} s)"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    folder.cleanup()


if __name__ == "__main__":
    main()
