"""The local sandbox's seccomp filter, against the real bwrap: every denied call fails inside, the runtime still
works, and the keyring cheat (answers left in the kernel keyring by one sample, read by another) scores 0."""

import ctypes
import ctypes.util
import json
import platform
import textwrap

import pytest

from posttrain.rewards.code import CodeReward
from posttrain.sandbox import RunRequest, seccomp
from posttrain.sandbox.build import Sandbox

ARCH = seccomp.this_arch()
pytestmark = pytest.mark.skipif(ARCH is None, reason=f"no seccomp table for {platform.machine()}")

SYSCALL = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def call(nr, *args):
    ctypes.set_errno(0)
    args = [ctypes.c_long(a) for a in args] + [ctypes.c_long(0)] * (6 - len(args))
    result = libc.syscall(ctypes.c_long(nr), *args)
    return result, errno.errorcode.get(ctypes.get_errno(), "0")
"""


def run(sandbox, code: str):
    result = sandbox.run(RunRequest(SYSCALL + textwrap.dedent(code)))
    assert result.status == "finished", result
    return result.stdout


def test_the_filter_is_installed(sandbox):
    out = run(sandbox, "print([l for l in open('/proc/self/status') if l.startswith('Seccomp')])")
    assert "Seccomp:\\t2" in out, out  # mode 2: a filter


def test_every_denied_call_fails_with_eperm(sandbox):
    numbers = {name: ARCH.numbers[name] for name in seccomp.DENIED if name in ARCH.numbers}
    out = run(sandbox, f"import json; print(json.dumps({{n: call(nr) for n, nr in {numbers!r}.items()}}))")
    answers = json.loads(out)
    assert {name: tuple(answer) for name, answer in answers.items()} == {n: (-1, "EPERM") for n in numbers}


def test_namespaces_ptrace_and_the_keyring_are_refused_where_the_kernel_would_allow_them(sandbox):
    """Calls an unprivileged program may make on an unfiltered kernel (a user namespace, PTRACE_TRACEME, a key
    in its own keyring, clone3): each is refused, so the filter, not a missing privilege, refuses it."""
    n = ARCH.numbers
    out = run(
        sandbox,
        f"""
        CLONE_NEWUSER = 0x10000000
        print(call({n["unshare"]}, CLONE_NEWUSER))
        print(call({n["ptrace"]}, 0))  # PTRACE_TRACEME
        key = ctypes.create_string_buffer(b"user")
        desc = ctypes.create_string_buffer(b"answer:1 2")
        print(call({n["add_key"]}, ctypes.addressof(key), ctypes.addressof(desc), 0, 0, -4))  # @u
        print(call({n["clone3"]}, 0, 0))
        print(call({n["clone"]}, CLONE_NEWUSER | 17))  # SIGCHLD
        """,
    )
    assert out.split("\n")[:5] == [
        "(-1, 'EPERM')",
        "(-1, 'EPERM')",
        "(-1, 'EPERM')",
        "(-1, 'ENOSYS')",
        "(-1, 'EPERM')",
    ], out


def test_the_runtime_still_works_under_the_filter(sandbox):
    """Threads (clone3 answers ENOSYS: the C library falls back to clone), fork, subprocess (posix_spawn) and
    multiprocessing's processes (not its locks or pools: POSIX semaphores need a writable /dev/shm)."""
    out = run(
        sandbox,
        """
        import subprocess, threading, multiprocessing
        t = threading.Thread(target=lambda: print("thread"))
        t.start(); t.join()
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        print(subprocess.run(["echo", "subprocess"], capture_output=True, text=True).stdout.strip())
        child = multiprocessing.get_context("fork").Process(target=lambda: print("process", flush=True))
        child.start(); child.join()
        """,
    )
    assert out.split() == ["thread", "fork", "7", "subprocess", "process"], out


def test_the_keyring_cheat_scores_zero(sandbox):
    """One sample stores each input's answer in the kernel keyring (the same host user id comes back to the
    next run as root); a later sample that solves nothing reads them back. Unfiltered, the second scored 1.0."""
    n = ARCH.numbers
    leaker = SYSCALL + textwrap.dedent(
        f"""
        import sys
        a, b = map(int, sys.stdin.read().split())
        desc, answer = ctypes.c_char_p(f"answer:{{a}} {{b}}".encode()), str(a + b).encode()
        payload = ctypes.create_string_buffer(answer)
        kind = ctypes.c_char_p(b"user")
        call({n["add_key"]}, ctypes.cast(kind, ctypes.c_void_p).value, ctypes.cast(desc, ctypes.c_void_p).value,
             ctypes.addressof(payload), len(answer), -4)  # KEY_SPEC_USER_KEYRING
        print(a + b)
        """
    )
    reader = SYSCALL + textwrap.dedent(
        f"""
        import sys
        a, b = map(int, sys.stdin.read().split())
        desc, kind = ctypes.c_char_p(f"answer:{{a}} {{b}}".encode()), ctypes.c_char_p(b"user")
        key, _ = call({n["keyctl"]}, 10, -4, ctypes.cast(kind, ctypes.c_void_p).value,  # KEYCTL_SEARCH
                      ctypes.cast(desc, ctypes.c_void_p).value, 0)
        buf = ctypes.create_string_buffer(64)
        got, _ = call({n["keyctl"]}, 11, key, ctypes.addressof(buf), 64)  # KEYCTL_READ
        print(buf.raw[: max(got, 0)].decode() or "nothing")
        """
    )
    truth = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})
    reward = CodeReward(Sandbox(sandbox, max_concurrent=1))  # one slot: the same user id every run
    fence = lambda code: f"```python\n{code}```"  # noqa: E731
    assert reward("", fence(leaker), truth, {}) == 1.0
    assert reward("", fence(reader), truth, {}) == 0.0


@pytest.mark.skipif(not ctypes.util.find_library("seccomp"), reason="libseccomp is not installed")
@pytest.mark.parametrize("arch", sorted(seccomp.ARCHES))
def test_the_syscall_tables_match_libseccomps(arch):
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp"))
    lib.seccomp_syscall_resolve_name_arch.restype = ctypes.c_int
    table = seccomp.ARCHES[arch]
    for name, number in table.numbers.items():
        theirs = lib.seccomp_syscall_resolve_name_arch(ctypes.c_uint32(table.audit_arch), name.encode())
        assert theirs == number, (arch, name, number, theirs)
