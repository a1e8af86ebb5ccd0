"""A Ray instance for the tests, started as posttrain starts one (loopback only, no dashboard: see
posttrain.parallel.ray_local), that leaves nothing behind:

- its session files go to a directory of its own (a short one under the system temp dir, since Ray's unix
  sockets must fit in 107 bytes; the test's tmp path gets a link to it), removed at the end;
- ``ray.shutdown`` runs in the fixture's finalizer, which pytest runs on failure, timeout and Ctrl-C, and on
  SIGTERM too (tests/conftest.py turns it into a stop of the session);
- if the test process is killed outright (SIGKILL), a watchdog process notices (its stdin pipe from the test
  process closes) and kills every process of that instance, which it recognises by a variable in their
  environment or as children of one (Ray's agents rewrite their own environment), then removes the directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

MARK = "POSTTRAIN_TEST_RAY"

WATCHDOG = r"""
import os, shutil, signal, sys, threading, time
parent, mark, temp_dir = int(sys.argv[1]), sys.argv[2].encode(), sys.argv[3]
seen = {}  # pid -> start time (so a reused pid is left alone)

def stat(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[1]), fields[19]  # ppid, start time

def scan():
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (parent, os.getpid()):
            try:
                procs[int(name)] = stat(int(name))
            except (OSError, IndexError):
                pass
    for pid in procs:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read():
                    seen[pid] = procs[pid][1]
        except OSError:
            pass
    for pid, (ppid, start) in procs.items():
        if ppid in seen:
            seen[pid] = start

def watch():
    while True:
        scan()
        time.sleep(0.5)

threading.Thread(target=watch, daemon=True).start()
sys.stdin.buffer.read()  # until the test process closes the pipe or dies
scan()
for pid, start in seen.items():
    try:
        if stat(pid)[1] == start:
            os.kill(pid, signal.SIGKILL)
    except (OSError, IndexError):
        pass
shutil.rmtree(temp_dir, ignore_errors=True)
"""


@contextmanager
def local_ray(tmp_path: Path, num_cpus: int):
    """Start Ray as posttrain does locally; yields the ray module. Everything it started ends with the block
    (or with this process)."""
    import ray

    from posttrain.parallel.ray_local import start_or_join

    temp_dir = tempfile.mkdtemp(prefix="ray-")
    (tmp_path / "ray-session").symlink_to(temp_dir)
    token = f"{MARK}={uuid.uuid4().hex}"
    watchdog = _start_watchdog(token, temp_dir) if sys.platform.startswith("linux") else None  # reads /proc
    os.environ[MARK] = token.split("=", 1)[1]  # only the processes Ray starts now inherit it
    try:
        start_or_join(ray, num_cpus=num_cpus, _temp_dir=temp_dir)
    finally:
        del os.environ[MARK]
    stop_on_sigterm()  # ray.init made SIGTERM a SystemExit inside the running test
    try:
        yield ray
    finally:
        try:
            ray.shutdown()
        finally:
            if watchdog is None:
                shutil.rmtree(temp_dir, ignore_errors=True)
            else:
                watchdog.stdin.close()  # anything left is killed, the directory removed
                watchdog.wait(timeout=30)


def _start_watchdog(token: str, temp_dir: str) -> subprocess.Popen:
    args = [sys.executable, "-c", WATCHDOG, str(os.getpid()), token, temp_dir]
    return subprocess.Popen(args, stdin=subprocess.PIPE, start_new_session=True)


def stop_on_sigterm() -> None:
    """SIGTERM stops the test session as Ctrl-C does (fixtures torn down), not just the running test."""

    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, stop)


def processes_of(root_pid: int) -> list[int]:
    """``root_pid``'s descendants (read from /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                ppid = int(Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
