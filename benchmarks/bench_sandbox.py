"""Sandbox throughput: executions per second of a trivial Python program, and the sandbox's overhead.

Run::

    python3 benchmarks/bench_sandbox.py            # 40 runs per row
    python3 benchmarks/bench_sandbox.py --runs 100

Rows: a plain subprocess (``python3 main.py`` with the sandbox's environment, no limits: the floor), the same under the rlimits only
(``sandbox.unsafe_no_isolation=true``), and the bubblewrap sandbox run one at a time and with
``max_concurrent`` 2 and 8 (``Sandbox.run_many``); and ``echo`` in bash, plain and sandboxed, which shows the
sandbox's own cost apart from interpreter start-up. The overhead is a row's median latency minus the plain
subprocess's of the same language. (Python's start-up depends on the ``.pth`` files of its site-packages,
which run inside the sandbox as outside.) Rows alternate in rounds so that load from other jobs hits them alike.

``--grpo-steps N`` measures instead what the code reward adds to a GRPO step on the built-in code data
(``examples/code/tiny_code.jsonl``, 4 prompts x 4 samples a step, the tiny model): N steps with
``reward.function=code`` against N with ``exact_match`` (no sandbox), the same seed, each at the default
``reward.timeout_s`` (a worker process); and a step's worth (16) of correct programs scored by the code reward
(every case runs), at ``sandbox.max_concurrent`` 4 (the default) and 8. The code reward's runs are scored after
generation and while the step generates (``reward.score_during_generation``), with all 16 samples in the engine
at once and 4 at a time (``rollout.max_num_seqs=4``: samples that end apart); the variants alternate in
``--rounds`` rounds::

    python3 benchmarks/bench_sandbox.py --grpo-steps 4 --rounds 2

``--cases``: seconds to score a step's worth (16) of correct programs of 3 and of 20 stdin/stdout cases, one
sandbox run per case (``sandbox.code_reward.cases_per_run=1``) against the default (the harness runs up to 16
cases in one sandbox run, a forked process each)::

    python3 benchmarks/bench_sandbox.py --cases --rounds 5

``--linger S``: for S seconds, with a busy loop per CPU, a program that leaves a detached process runs again
and again; how often a process of the sandbox is still listed right after a run returns, with the run's wait
for its namespace's init and without it (as root)::

    python3 benchmarks/bench_sandbox.py --linger 120 --rounds 2

``--grpo-steps N --sandbox-host`` puts the sandbox on a CPU of its own, as sandbox hosts (or a GPU rollout, which
leaves the CPUs free) give it: this process, the trainer, runs on CPU 0 with one torch thread, and
``posttrain sandbox serve`` on CPU 1 serves ``sandbox.backend=sandbox_fusion``. The policy is ``builtin:base``
after 60 SFT steps on the data's solutions, so its samples end apart, as a real policy's do (192-token
responses). Variants: ``exact_match``, and the code reward on the host scored after generation and with
``reward.score_during_generation=auto`` (during, since the programs run on the host)::

    python3 benchmarks/bench_sandbox.py --grpo-steps 6 --rounds 2 --sandbox-host

``--grpo-steps N --warm``: the warm-started policy on this machine's CPUs with the local sandbox; variants
``exact_match`` and the code reward scored after generation, its cases in one sandbox run (the default) and
one run per case (``sandbox.code_reward.cases_per_run=1``)::

    python3 benchmarks/bench_sandbox.py --grpo-steps 6 --rounds 2 --warm

``--grpo-steps N --gpu``: the same warm-started policy, trained and generating on CUDA, with the local sandbox
on the machine's CPUs (the case ``auto`` scores during generation for); variants ``exact_match`` and the code
reward after generation, with ``auto``, and with ``auto`` and a run per case::

    python3 benchmarks/bench_sandbox.py --grpo-steps 6 --rounds 2 --gpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


CODE_DATA = Path(__file__).resolve().parents[1] / "examples/code/tiny_code.jsonl"
SOLUTIONS = [  # right answers to the six problems of CODE_DATA, in its order
    "a, b = map(int, input().split())\nprint(a + b)",
    "print(input()[::-1])",
    "for i in range(1, int(input()) + 1):\n    print(i)",
    "def add(a, b):\n    return a + b",
    "def is_palindrome(s):\n    return s == s[::-1]",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
]


def grpo_run(
    model: Path, run_dir: Path, reward: str, steps: int, *extra: str, length: int = 64
) -> list[dict]:
    from posttrain.config.load import build_config
    from posttrain.rl.train_command import run_training
    from posttrain.utils.metrics import read_metrics

    overrides = [f"model.path={model}", f"trainer.run_dir={run_dir}", "trainer.loggers=[jsonl]"]
    overrides += [f"trainer.total_steps={steps}", "trainer.test_freq=0", f"data.train_files=[{CODE_DATA}]"]
    overrides += [
        "data.answer_key=answer",
        "data.train_batch_size=4",
        "rollout.n=4",
        "data.max_prompt_length=256",
    ]
    overrides += [
        f"data.max_response_length={length}",
        "actor.ppo_mini_batch_size=4",
        f"reward.function={reward}",
    ]
    overrides += ["actor.ppo_micro_batch_size_per_gpu=16", *extra]
    run_training(build_config(overrides=overrides), quiet=True)
    return read_metrics(run_dir / "metrics.jsonl")


def scoring_a_step(max_concurrent: int, rounds: int) -> list[float]:
    """Seconds to score 16 correct programs (every test case runs) with the code reward, in the runner."""
    from posttrain.config.schema.sandbox import SandboxConfig
    from posttrain.rewards import RewardInput, RewardRunner, resolve_reward_function
    from posttrain.sandbox.build import RunSandbox

    rows = [json.loads(line) for line in CODE_DATA.open()]
    samples = [
        RewardInput("", f"```python\n{SOLUTIONS[i % 6]}\n```", rows[i % 6]["answer"]) for i in range(16)
    ]
    run_sandbox = RunSandbox(SandboxConfig(max_concurrent=max_concurrent))
    out = []
    with RewardRunner(resolve_reward_function("code", sandbox=run_sandbox), timeout_s=10.0) as runner:
        for _ in range(rounds):
            rewards, metrics = runner.score(samples)
            assert rewards == [1.0] * 16, rewards
            out.append(metrics["reward/time_s"])
    return out


# (label, reward, overrides): scored after generation ("after": the code reward's default on a CPU rollout) or
# while the step generates ("during": its default on a GPU rollout); all 16 samples in the engine at once, or 4
# at a time (waves that end apart).
GRPO_VARIANTS = [
    ("exact_match", "exact_match", ()),
    ("code, after", "code", ("reward.score_during_generation=never",)),
    (
        "code, after, run per case",
        "code",
        ("reward.score_during_generation=never", "sandbox.code_reward.cases_per_run=1"),
    ),
    ("code, during", "code", ("reward.score_during_generation=always",)),
    ("code, after, 4 seqs", "code", ("reward.score_during_generation=never", "rollout.max_num_seqs=4")),
    ("code, during, 4 seqs", "code", ("reward.score_during_generation=always", "rollout.max_num_seqs=4")),
]


def variant_table(
    model: Path, work: Path, variants: list, steps: int, rounds: int, length: int = 64
) -> list[dict]:
    """Run each variant's ``steps`` GRPO steps, alternating in ``rounds`` rounds, and print its medians over the
    steps after the first; returns the last run's metrics."""
    print(
        f"{'variant':26} {'step s':>7} {'rollout s':>9} {'scoring ms':>10} {'wait ms':>8}  "
        f"(medians of the {steps - 1} steps after the first; wait: scoring left after generation)"
    )
    for r in range(rounds):  # variants alternate, so load from other jobs hits them alike
        for label, reward, extra in variants:
            run_dir = work / f"{label.replace(' ', '').replace(',', '_')}_{r}"
            runs = grpo_run(model, run_dir, reward, steps, *extra, length=length)[
                1:
            ]  # the first step warms up
            step, rollout, scoring, wait = (
                statistics.median(m[key] for m in runs)
                for key in ("timing/step", "timing/rollout", "reward/time_s", "reward/wait_s")
            )
            print(f"{label:26} {step:7.2f} {rollout:9.2f} {scoring * 1e3:10.1f} {wait * 1e3:8.1f}")
        print(f"  round {r + 1} done, load average {os.getloadavg()[0]:.1f}")
    return runs


def grpo_steps(steps: int, rounds: int) -> None:
    from posttrain.models.tiny import create_tiny_model_dir

    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory() as d:
        model = create_tiny_model_dir(Path(d) / "model", seed=0)
        runs = variant_table(model, Path(d), GRPO_VARIANTS, steps, rounds)
        counts = {k.split("/")[-1]: runs[-1][k] for k in runs[-1] if k.startswith("reward/code/")}
        print(f"  last step's code counts: {counts}; finish/eos {runs[-1]['finish/eos']:.2f}")
    for k in (4, 8):
        times = scoring_a_step(k, 3)
        print(
            f"16 correct programs (52 cases), max_concurrent {k}: {statistics.median(times):.2f} s per step"
        )
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def warm_start(work: Path, steps: int) -> Path:
    """``builtin:base`` fine-tuned on the code data's solutions (a fenced block each): a policy that writes
    programs of different lengths and ends them itself, as a real one does."""
    from posttrain.config.load import build_config
    from posttrain.sft.command import run_sft_command

    rows = [json.loads(line) for line in CODE_DATA.open()]
    demos = work / "demos.jsonl"
    lines = [
        json.dumps({"prompt": r["prompt"], "response": f"```python\n{SOLUTIONS[i]}\n```"})
        for i, r in enumerate(rows)
    ]
    demos.write_text("\n".join(lines * 8) + "\n")
    overrides = [
        "model.path=builtin:base",
        f"sft.train_files=[{demos}]",
        f"sft.max_steps={steps}",
        "sft.epochs=100",
    ]
    overrides += [
        "sft.batch_size=8",
        "sft.micro_batch_size_per_gpu=8",
        "sft.optim.lr=1e-3",
        "trainer.test_freq=0",
    ]
    overrides += [
        f"trainer.run_dir={work / 'sft'}",
        "data.max_prompt_length=256",
        "data.max_response_length=192",
    ]
    return run_sft_command(build_config(overrides=overrides), quiet=True)


def warm_policy_table(work: Path, variants: list, steps: int, rounds: int) -> None:
    """The warm-started policy's GRPO steps under ``variants`` (192-token responses), and its last step's shape."""
    start = time.monotonic()
    model = warm_start(work, 60)
    print(f"warm start: 60 SFT steps of builtin:base on the solutions, {time.monotonic() - start:.0f} s")
    last = variant_table(model, work, variants, steps, rounds, length=192)[-1]
    print(
        f"  last step: finish/eos {last['finish/eos']:.2f}, response_length/mean "
        f"{last['response_length/mean']:.0f}, reward/mean {last['reward/mean']:.2f}, cases run (a compile error counts one) "
        f"{last['reward/code/cases'] + last['reward/code/compile_errors']:.0f}"
    )


def sandbox_host_steps(steps: int, rounds: int) -> None:
    """The code reward with the sandbox on CPUs of its own: this process (the trainer, one torch thread) on CPU 0,
    ``posttrain sandbox serve`` on CPU 1 as a sandbox host (``sandbox.backend=sandbox_fusion``), and a warm-started
    policy whose samples end apart. ``auto`` then scores during generation."""
    import socket

    import torch

    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("--sandbox-host needs 2 CPUs: one for the trainer, one for the sandbox host")
    os.sched_setaffinity(0, {0})  # threads and processes started from here on inherit it
    torch.set_num_threads(1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "posttrain", "sandbox", "serve", "--port", str(port)]
    host = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {1})
    )
    try:
        print(host.stdout.readline().strip())
        on_host = ("sandbox.backend=sandbox_fusion", f"sandbox.sandbox_fusion.url=http://127.0.0.1:{port}")
        variants = [
            ("exact_match", "exact_match", ()),
            ("code on the host, after", "code", (*on_host, "reward.score_during_generation=never")),
            ("code on the host, auto", "code", on_host),
        ]
        print(
            f"trainer on CPU 0 (1 thread), sandbox host on CPU 1; load average {os.getloadavg()[0]:.1f} at the start"
        )
        with tempfile.TemporaryDirectory() as d:
            warm_policy_table(Path(d), variants, steps, rounds)
    finally:
        host.terminate()
        host.wait()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def warm_steps(steps: int, rounds: int) -> None:
    """The warm-started policy (programs that compile and pass) with the local sandbox on this machine: the code
    reward's cases in one run each against a run per case, both scored after generation."""
    after = "reward.score_during_generation=never"
    variants = [
        ("exact_match", "exact_match", ()),
        ("code, after", "code", (after,)),
        ("code, after, run per case", "code", (after, "sandbox.code_reward.cases_per_run=1")),
    ]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory() as d:
        warm_policy_table(Path(d), variants, steps, rounds)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def gpu_steps(steps: int, rounds: int) -> None:
    """The code reward beside a GPU rollout: the warm-started policy trains and generates on CUDA, the local
    sandbox runs on this machine's CPUs; ``auto`` scores during generation there."""
    import torch

    on_gpu = ("trainer.device=cuda",)
    variants = [
        ("exact_match", "exact_match", on_gpu),
        ("code, after", "code", (*on_gpu, "reward.score_during_generation=never")),
        ("code, auto", "code", on_gpu),
        ("code, auto, run per case", "code", (*on_gpu, "sandbox.code_reward.cases_per_run=1")),
    ]
    print(f"{os.cpu_count()} CPUs, GPU {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory() as d:
        warm_policy_table(Path(d), variants, steps, rounds)


def cases_table(rounds: int) -> None:
    """Seconds to score 16 correct programs of N stdin/stdout cases each with the code reward, one sandbox run
    per case (``sandbox.code_reward.cases_per_run=1``) against the default (up to 16 cases a run, a forked
    process each), at ``max_concurrent`` 4; the variants alternate in rounds."""
    from posttrain.rewards.code import CodeReward

    program = "a, b = map(int, input().split())\nprint(a + b)"
    box = Sandbox(LocalSandbox(Limits(time_limit_s=10)), 4)
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(rounds):
        for n in (3, 20):
            cases = json.dumps(
                {"inputs": [f"{i} 1\n" for i in range(n)], "outputs": [str(i + 1) for i in range(n)]}
            )
            for per_run in (1, 16):
                reward = CodeReward(box, cases_per_run=per_run)
                start = time.perf_counter()
                with ThreadPoolExecutor(
                    4
                ) as pool:  # as the reward runner scores: max_concurrent samples at once
                    scores = list(pool.map(reward, [""] * 16, [program] * 16, [cases] * 16, [{}] * 16))
                times.setdefault((n, per_run), []).append(time.perf_counter() - start)
                assert scores == [1.0] * 16, scores
    print(
        f"{'cases per sample':>16} {'run per case s':>14} {'one run s':>10} {'ratio':>6}  (16 samples, medians)"
    )
    for n in (3, 20):
        one, many = (statistics.median(times[(n, k)]) for k in (1, 16))
        print(f"{n:16d} {one:14.3f} {many:10.3f} {one / many:6.2f}")


LEAVES_ONE = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(1)"


def linger_table(seconds: float, rounds: int) -> None:
    """How often a process of the sandbox is still listed right after a run returns. A program that leaves a
    detached process runs again and again for ``seconds``, with a busy loop per CPU loading the machine, with
    the run's wait for its namespace's init (the default) and without it (patched out here, to compare); the
    two alternate in ``rounds``. As root only (the processes are counted by the sandbox's user ids)."""
    import posttrain.sandbox.local as local

    box = LocalSandbox(Limits(time_limit_s=10))
    if not box.as_root:
        sys.exit("--linger counts processes by the sandbox's user ids, which only a root trainer gives")
    waits = {"with the wait": local.wait_for_namespace, "without it": os.close}
    counts = {label: [0, 0] for label in waits}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        for _ in range(rounds):
            for label, wait in waits.items():
                local.wait_for_namespace = wait
                end = time.monotonic() + seconds / rounds
                while time.monotonic() < end:
                    assert box.run(RunRequest(LEAVES_ONE)).stdout.strip() == "1"
                    counts[label][0] += 1
                    counts[label][1] += bool(local.sandbox_user_pids())
                    while local.sandbox_user_pids():  # the next run starts with nothing left
                        time.sleep(0.001)
    finally:
        local.wait_for_namespace = waits["with the wait"]
        for hog in hogs:
            hog.kill()
            hog.wait()
    for label, (runs, listed) in counts.items():
        print(f"{label:14} a sandbox process listed right after {listed} of {runs} runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="executions per row and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--grpo-steps", type=int, default=0, help="measure the code reward in N GRPO steps")
    parser.add_argument(
        "--sandbox-host",
        action="store_true",
        help="with --grpo-steps: the sandbox on a CPU of its own (see above)",
    )
    parser.add_argument(
        "--warm", action="store_true", help="with --grpo-steps: the warm-started policy on CPU (see above)"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="with --grpo-steps: the warm-started policy on CUDA (see above)"
    )
    parser.add_argument(
        "--linger",
        type=float,
        default=0,
        help="seconds of runs counting processes listed after a run (above)",
    )
    parser.add_argument(
        "--cases", action="store_true", help="the code reward per test case: a run each against one run"
    )
    args = parser.parse_args()
    if args.cases:
        cases_table(args.rounds)
        return
    if args.linger:
        linger_table(args.linger, args.rounds)
        return
    if args.grpo_steps and args.gpu:
        gpu_steps(args.grpo_steps, args.rounds)
        return
    if args.grpo_steps and args.warm:
        warm_steps(args.grpo_steps, args.rounds)
        return
    if args.grpo_steps and args.sandbox_host:
        sandbox_host_steps(args.grpo_steps, args.rounds)
        return
    if args.grpo_steps:
        grpo_steps(args.grpo_steps, args.rounds)
        return
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
