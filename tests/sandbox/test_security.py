"""Hostile code against the real bubblewrap sandbox: each test runs what a model might write and asserts that
the sandbox held (docs/sandbox.md lists each as the proof of a claim)."""

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from posttrain.sandbox import Limits, LocalSandbox, RunRequest
from tests.sandbox_support import child_pids, ordinary_user_only, root_only, sandbox_pids

PROJECT = Path(__file__).resolve().parents[2]


def run(sandbox, code: str, **kw):
    return sandbox.run(RunRequest(textwrap.dedent(code), **kw))


# --- network ---------------------------------------------------------------------------------------------


def test_a_server_on_the_hosts_loopback_is_unreachable(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    try:
        r = run(
            sandbox,
            f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("connected")
            except OSError as e:
                print("blocked", type(e).__name__)
            """,
        )
        accepted = True
        try:
            server.accept()
        except TimeoutError:
            accepted = False
    finally:
        server.close()
    assert r.stdout.startswith("blocked"), r
    assert not accepted


def test_dns_fails_and_only_loopback_exists(sandbox):
    r = run(
        sandbox,
        """
        import socket
        try:
            socket.getaddrinfo("pypi.org", 443)
            print("resolved")
        except OSError as e:
            print("no dns")
        print(sorted(name for _, name in socket.if_nameindex()))
        """,
    )
    assert r.stdout.split("\n")[:2] == ["no dns", "['lo']"], r


# --- files -----------------------------------------------------------------------------------------------


def test_project_home_and_host_files_are_not_visible(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    home = os.path.expanduser("~")
    r = run(
        sandbox,
        f"""
        import os
        for path in [{str(PROJECT / "pyproject.toml")!r}, {str(secret)!r}, "/etc/shadow", "/root/.bash_history"]:
            try:
                print(path, open(path).read()[:20])
            except OSError as e:
                print(path, "unreadable")
        for d in [{str(PROJECT)!r}, "/home", {home!r}]:
            try:
                print(d, sorted(os.listdir(d)))
            except OSError:
                print(d, "missing")
        """,
    )
    lines = r.stdout.splitlines()
    assert all(line.endswith("unreadable") for line in lines[:4]), r
    assert lines[4].endswith("missing") or lines[4].endswith("[]"), r  # the project
    assert lines[5].endswith("missing") or lines[5].endswith("[]"), r  # /home
    # the home shows at most the way to this interpreter (its install is bound read-only), nothing else
    shown = lines[6].split(" ", 1)[1]
    assert shown == "missing" or all(sys_part in sys_prefix_parts() for sys_part in eval(shown)), r
    assert "hunter2" not in r.stdout


def sys_prefix_parts() -> set[str]:
    import sys

    return set(Path(os.path.realpath(sys.base_prefix)).parts) | set(
        Path(os.path.realpath(sys.executable)).parts
    )


def test_writes_outside_the_private_tmp_fail(sandbox):
    r = run(
        sandbox,
        """
        import os
        paths = ["/usr/x", "/etc/x", "/x", "/proc/x", "/dev/x", "/dev/shm/x", "/root/x", "/sandbox-dir/x"]
        for path in paths + [os.path.realpath(os.__file__)]:
            try:
                if path.endswith("-dir/x"):
                    os.mkdir(os.path.dirname(path))
                open(path, "a").write("x")
                print(path, "written")
            except OSError:
                print(path, "refused")
        open("/tmp/ok.txt", "w").write("fine")
        print(open("/tmp/ok.txt").read())
        """,
    )
    lines = r.stdout.splitlines()
    assert all(line.endswith("refused") for line in lines[:-1]), r
    assert lines[-1] == "fine"


def test_nothing_of_a_run_is_on_the_hosts_disk(sandbox, tmp_path, monkeypatch):
    """The run's files are copied into its tmpfs by bwrap; nothing is staged in (or left in) a host directory,
    even by a tree too deep for a recursive clean-up."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    deep = "import os\nfor _ in range(3000):\n    os.mkdir('d'); os.chdir('d')\nprint(len(os.getcwd()))"
    r = run(sandbox, deep, files={"input.txt": b"x" * 1000})
    assert r.status == "finished" and int(r.stdout) > 6000, r
    assert list(tmp_path.iterdir()) == []
    again = run(sandbox, "import os; print(sorted(os.listdir('/tmp')))")
    assert again.stdout.strip() == "['main.py']", again  # the next run starts empty


def test_the_private_tmp_is_capped_and_its_memory_given_back(sandbox):
    """/tmp is a tmpfs of sandbox.max_disk_mb (16 MiB here): files past it fail with ENOSPC; the next run
    finds the space free again."""
    fill = """
        import errno
        written = 0
        try:
            for i in range(100):
                with open(f"/tmp/f{i}", "wb") as f:
                    f.write(b"x" * 1_000_000)  # under the per-file cap of 1 MiB
                written += 1
        except OSError as exc:
            print(written, errno.errorcode[exc.errno])
        """
    for _ in range(2):
        r = run(sandbox, fill)
        count, error = r.stdout.split()
        assert 10 <= int(count) <= 16 and error == "ENOSPC", r


def test_a_killed_caller_leaves_no_process_and_no_directory(tmp_path):
    """The process that runs a sandbox dies mid-run (a reward worker killed at its timeout): bwrap dies with it
    (--die-with-parent) and no directory stays behind."""
    script = textwrap.dedent(
        f"""
        import os, tempfile
        tempfile.tempdir = {str(tmp_path)!r}
        from posttrain.sandbox import LocalSandbox, RunRequest
        print(os.getpid(), flush=True)
        LocalSandbox().run(RunRequest("import time; open('/tmp/x', 'w').write('x'); time.sleep(300)"))
        """
    )
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(PROJECT)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    pid = int(proc.stdout.readline())
    time.sleep(1.0)  # the sandbox is running
    proc.kill()
    proc.wait()
    first = 1_000_000_000 + (pid % (1 << 22)) * 256  # that process's sandbox user ids (as root)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _uids_running(first, first + 256):
        time.sleep(0.05)
    assert not _uids_running(first, first + 256)
    assert list(tmp_path.iterdir()) == []


def _uids_running(low: int, high: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and low <= os.stat(f"/proc/{entry}").st_uid < high:
                out.append(int(entry))
        except FileNotFoundError:
            pass
    return out


# --- processes -------------------------------------------------------------------------------------------


def test_host_processes_are_invisible(sandbox):
    r = run(sandbox, "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    pids = eval(r.stdout)
    assert pids == [1, 2], r  # bwrap's init and the program: nothing of the host


def test_a_fork_bomb_is_contained_and_the_machine_stays_usable(sandbox):
    before = child_pids()  # earlier tests of the session may have children of their own
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(len(sandbox_pids()))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = run(
            sandbox,
            """
            import os, time
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
            """,
            time_limit_s=3,
        )
    finally:
        stop.set()
        watcher.join()
    assert r.status == "time_limit", r
    # sandbox.max_processes of the fixture: the bomb never had more processes (and the count saw it)
    assert 0 < max(seen) <= 16
    assert subprocess.run(["true"], timeout=10).returncode == 0  # the host still forks
    assert sandbox_pids() == [] and set(child_pids()) <= set(before)


def test_no_process_survives_the_call(sandbox):
    before = child_pids()
    r = run(
        sandbox,
        """
        import subprocess, os
        subprocess.Popen(["sleep", "300"], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                import time; time.sleep(300)
            os._exit(0)
        print("left children behind")
        """,
    )
    assert r.stdout.strip() == "left children behind", r
    assert sandbox_pids() == []
    assert child_pids() == before


def test_the_call_returns_after_the_namespace_is_gone(sandbox):
    """bwrap can exit a moment before its namespace's init, which empties the namespace as it exits; the run
    waits for that init, so no process, not even one the kernel is still removing, is listed when it returns
    (without the wait, 2 runs in 1,477 listed one on 2 loaded cores: benchmarks/bench_sandbox.py --linger). Under
    no load a run without the wait rarely lists one, so this test guards the wait more than it proves it."""
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('left one')"
    for _ in range(30):
        assert run(sandbox, code).stdout.strip() == "left one"
        assert sandbox_pids() == []


@root_only
def test_as_root_each_concurrent_run_has_a_user_id_of_its_own(sandbox):
    """RLIMIT_NPROC binds root neither outside nor as the root of a user namespace: the program runs under an
    unprivileged id, one per concurrent run, so the process limit holds and counts only that run's processes."""
    code = "import os, time; time.sleep(0.5); print(os.getuid(), os.getgid(), os.getgroups())"
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run(sandbox, code), range(2)))
    ids = [r.stdout.split(" ", 2) for r in results]
    assert all(
        uid == gid and int(uid) >= 1_000_000_000 and groups.strip() == "[]" for uid, gid, groups in ids
    )
    assert ids[0][0] != ids[1][0], results
    assert "own user id per sandbox" in sandbox.describe()


@ordinary_user_only
def test_as_an_ordinary_user_the_program_keeps_the_users_id(sandbox):
    """Without root, bwrap's user namespace maps only the caller's id: the program runs as this user (its
    processes count against this user's RLIMIT_NPROC, docs/sandbox.md)."""
    r = run(sandbox, "import os; print(os.getuid(), os.getgid())")
    assert r.stdout.split() == [str(os.getuid()), str(os.getgid())], r
    assert "user namespace" in sandbox.describe()


# --- resources -------------------------------------------------------------------------------------------


def test_an_infinite_loop_ends_at_the_time_limit(sandbox):
    r = run(sandbox, "while True: pass", time_limit_s=1.5)
    assert r.status == "time_limit" and r.exit_code is None, r
    assert r.duration_s < 5


def test_sleeping_forever_ends_at_the_wall_clock_limit(sandbox):
    r = run(sandbox, "import time; time.sleep(1000)", time_limit_s=1)
    assert r.status == "time_limit", r


def test_ten_times_the_memory_limit_is_a_memory_limit(sandbox):
    r = run(sandbox, "x = bytearray(10 * 256 * 1024 * 1024); print('allocated')")
    assert r.status == "memory_limit", r
    assert "allocated" not in r.stdout


def test_a_file_larger_than_the_cap_cannot_be_written(sandbox):
    r = run(
        sandbox,
        """
        try:
            with open("/tmp/big", "wb") as f:
                f.write(b"x" * (5 * 1024 * 1024))
            print("written")
        except OSError as e:
            print("refused", e.errno)
        import os; print(os.path.getsize("/tmp/big") <= 1024 * 1024)
        """,
    )
    assert r.stdout.split() == ["refused", "27", "True"], r  # EFBIG


def test_printing_100_mb_returns_capped_output(sandbox):
    r = run(sandbox, "import sys\nfor _ in range(100): sys.stdout.write('x' * 1024 * 1024)")
    assert r.status == "output_truncated", r
    assert len(r.stdout) == 65536 and set(r.stdout) == {"x"}


# --- environment -----------------------------------------------------------------------------------------


def test_the_trainers_environment_is_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET_TOKEN", "hf_secret_123")
    r = run(
        sandbox,
        """
        import os
        print(sorted(os.environ))
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    print(open(f"/proc/{pid}/environ", "rb").read())
                except OSError:
                    pass
        """,
    )
    assert "hf_secret_123" not in r.stdout and "POSTTRAIN_TEST_SECRET_TOKEN" not in r.stdout, r
    names = set(
        eval(r.stdout.splitlines()[0])
    )  # only the sandbox's own (LC_CTYPE, PWD: set by Python, bwrap)
    assert names <= {
        "HOME",
        "LANG",
        "LC_CTYPE",
        "PATH",
        "PWD",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONIOENCODING",
        "TMPDIR",
    }


def test_the_cpu_time_limit_stops_a_busy_program_before_the_wall_clock():
    box = LocalSandbox(Limits(time_limit_s=30, cpu_time_limit_s=1))
    r = box.run(RunRequest("while True: pass"))
    assert r.status == "time_limit" and r.exit_code == 128 + 24, r  # SIGXCPU, reported by bwrap as 128 + 24
    assert r.duration_s < 30
