"""A cgroup per sandbox run (as root, where the machine lets one be made): the whole run's memory, kernel memory
included, and its CPU are capped, however many processes it forks; no group is left behind."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from posttrain.sandbox import Limits, LocalSandbox, RunRequest, cgroup
from posttrain.sandbox.local import run_memory_bytes

LIMITS = Limits(time_limit_s=6.0, memory_limit_mb=128, max_processes=16, max_file_size_mb=1, max_disk_mb=16)


def _groups_possible() -> bool:
    group = cgroup.RunGroup.create(1 << 30) if os.geteuid() == 0 else None
    if group is not None:
        group.remove()
    return group is not None


pytestmark = pytest.mark.skipif(not _groups_possible(), reason="no writable cgroup tree here (or not root)")


@pytest.fixture(scope="module")
def box(sandbox):  # noqa: ARG001 (the bwrap check of conftest's fixture)
    return LocalSandbox(LIMITS)


def _our_groups() -> list[str]:
    return [str(p) for parent in (cgroup._parents() or {}).values() for p in parent.glob(cgroup.PREFIX + "*")]


def _lowest_available_during(fn) -> tuple[object, int]:
    """fn's result and the largest drop of the host's MemAvailable (bytes) while it ran."""

    def available() -> int:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))

    base, low, stop = available(), [available()], threading.Event()

    def watch():
        while not stop.is_set():
            low[0] = min(low[0], available())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = fn()
    finally:
        stop.set()
        watcher.join()
    return result, base - low[0]


def test_many_processes_under_the_memory_limit_cannot_add_up(box):
    """Six processes of 100 MiB each, every one under the 128 MiB per-process limit: the run's group (2 x 128 +
    16 MiB) stops them; without it they held 600 MiB of host memory."""
    code = textwrap.dedent(
        """
        import os, time
        children = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                block = bytearray(100 * 1024 * 1024)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(1)
                os._exit(0)
            children.append(pid)
        print(sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == -9 for p in children), "killed")
        """
    )
    result, drop = _lowest_available_during(lambda: box.run(RunRequest(code)))
    killed = int(result.stdout.split()[0])
    assert killed >= 3, result
    assert drop < run_memory_bytes(LIMITS) + (150 << 20), drop
    assert _our_groups() == []


def test_a_flood_of_empty_files_cannot_take_the_hosts_memory(box):
    """Empty files cost no tmpfs bytes but an inode and a dentry each in kernel memory: 750 MB of host memory in
    10 s without a group; the group's cap counts them."""
    small = Limits(time_limit_s=6.0, memory_limit_mb=64, max_disk_mb=16)  # a group of 144 MiB
    code = "import os\nn = 0\nwhile True:\n    os.mknod(f'/tmp/{n:x}'); n += 1"
    result, drop = _lowest_available_during(lambda: LocalSandbox(small).run(RunRequest(code)))
    assert result.status in ("time_limit", "memory_limit", "error"), result
    assert drop < run_memory_bytes(small) + (100 << 20), drop


def test_forked_busy_loops_share_one_core(box):
    """Four busy processes for 2 s of wall-clock time use at most about one core's 2 s of CPU: the run's CPU is
    bounded by its time, not multiplied by its forks (RLIMIT_CPU is per process)."""
    code = textwrap.dedent(
        """
        import os, time
        children = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                end = time.monotonic() + 2
                while time.monotonic() < end:
                    pass
                os._exit(0)
            children.append(pid)
        for p in children:
            os.waitpid(p, 0)
        t = os.times()
        print(t.children_user + t.children_system)
        """
    )
    result = box.run(RunRequest(code))
    assert result.status == "finished", result
    assert float(result.stdout) < 2.6, result


def test_a_group_left_by_a_killed_caller_is_swept(box, tmp_path):
    script = textwrap.dedent(
        """
        import os
        from posttrain.sandbox import LocalSandbox, RunRequest
        print(os.getpid(), flush=True)
        LocalSandbox().run(RunRequest("import time; time.sleep(300)"))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    pid = proc.stdout.readline().strip()
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    time.sleep(0.3)  # bwrap dies with its parent
    assert any(f"{cgroup.PREFIX}{pid}-" in g for g in _our_groups())
    assert cgroup.sweep() >= 1
    assert not any(f"{cgroup.PREFIX}{pid}-" in g for g in _our_groups())


def test_a_dead_callers_group_that_still_holds_a_process_is_emptied_and_removed():
    """A caller killed while bwrap was starting left bwrap waiting forever for a child that was gone, in the
    caller's group: the sweep kills what such a group holds, then removes it."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now: the group's owner is dead
    parent = next(iter(cgroup._parents().values()))
    group = parent / f"{cgroup.PREFIX}{gone.pid}-0"
    group.mkdir()
    stray = subprocess.Popen(["sleep", "300"])
    try:
        (group / "cgroup.procs").write_text(str(stray.pid))
        assert cgroup.sweep() >= 1
        assert stray.wait(timeout=10) == -9 and not group.exists()
    finally:
        stray.kill()
        stray.wait()
        if group.exists():  # a group whose processes are dead can be removed
            group.rmdir()
