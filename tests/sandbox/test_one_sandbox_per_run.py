"""One sandbox per run: the python tool (in the trainer) and the code reward (in its forked workers) share the
run's sandbox, so together they never run more than `sandbox.max_concurrent` programs at once."""

import json
import os
import threading
import time

from posttrain.agents.build import environment_factory
from posttrain.config.load import build_config
from posttrain.rewards.runner import RewardInput
from posttrain.rl.build import build_reward_runner
from posttrain.sandbox.build import RunSandbox
from tests.local_ray import processes_of

SLEEP = "import time; time.sleep(0.6); print(3)"


def _running_programs() -> int:
    """This test's sandboxed programs: processes that are not bwrap whose parent is a bwrap, whether this process
    or a reward worker it forked started the sandbox. Programs, not sandboxes, are what the cap bounds, and they
    count one per run at every moment: bwrap's outer process can exit before its namespace's init does, and the
    init, handed to another parent, would then read as a second sandbox for a moment (seen once in CI)."""
    procs = {}
    for entry in map(str, processes_of(os.getpid())):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    name, rest = f.read().rsplit(")", 1)
                state, ppid = rest.split()[:2]
                if state not in ("Z", "X"):  # an exited process, not yet reaped, runs nothing
                    procs[int(entry)] = (name.split("(", 1)[1], int(ppid))
            except (OSError, IndexError, ValueError):
                pass
    return sum(comm != "bwrap" and procs.get(ppid, ("",))[0] == "bwrap" for comm, ppid in procs.values())


def test_the_python_tool_and_the_code_reward_share_max_concurrent(sandbox):  # noqa: ARG001 (bwrap check)
    cfg = build_config(
        overrides=[
            "rollout.multi_turn.enable=true",
            "env.path=python",
            "sandbox.max_concurrent=2",
            "sandbox.time_limit_s=5",
            "sandbox.memory_limit_mb=256",
            "reward.timeout_s=20",
        ]
    )
    run_sandbox = RunSandbox(cfg.sandbox)
    env = environment_factory(cfg, run_sandbox)({})
    assert env.tools["python"].fn.sandbox is run_sandbox.get()  # the run's sandbox, built once
    truth = json.dumps({"inputs": ["\n"], "outputs": ["3\n"]})
    samples = [RewardInput("", f"```python\n{SLEEP}\n```", truth) for _ in range(6)]
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(_running_programs())
            time.sleep(0.01)

    with build_reward_runner(cfg, "code", "", run_sandbox) as runner:
        watcher = threading.Thread(target=watch)
        watcher.start()
        tool_outputs = []  # list.append is atomic: the four calls' threads share it
        tool_calls = [
            threading.Thread(target=lambda: tool_outputs.append(env.tools["python"].fn(SLEEP)))
            for _ in range(4)
        ]
        try:
            for t in tool_calls:
                t.start()
            rewards, _ = runner.score(samples)
            for t in tool_calls:
                t.join()
        finally:
            stop.set()
            watcher.join()
    # Both users ran their programs (so the count below is not of an idle sandbox): every tool call printed 3
    # and every sample's program passed its test case.
    assert tool_outputs == ["3"] * 4, tool_outputs
    assert rewards == [1.0] * 6
    # Never past the cap. Reaching it is likely (4 + 6 programs of 0.6 s were waiting) but not certain on a
    # loaded machine, where one program may end before the next starts: that is not what this test proves.
    assert 1 <= max(seen) <= 2, max(seen)
