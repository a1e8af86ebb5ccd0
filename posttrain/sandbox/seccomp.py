"""The seccomp filter of the local sandbox: system calls that no test program or tool needs and that reach
past what bubblewrap's namespaces isolate (the kernel keyring, tracing, new namespaces, io_uring, BPF...).

The filter is a classic BPF program built here from the table below (a few dozen instructions; no library
needed) and handed to bwrap with ``--seccomp FD``, which installs it just before the program starts. A denied
call fails with EPERM (the program sees an ordinary error, nothing is killed). ``clone`` is allowed unless its
flags ask for a new namespace; ``clone3`` answers ENOSYS, so the C library falls back to ``clone``, whose flags
the filter can read (``clone3`` passes them in memory, out of a filter's reach). Calls of another ABI (32-bit
``int 0x80``, x32) answer ENOSYS: their numbers are not the ones listed.

Why each group is denied:
- keyring (add_key, request_key, keyctl): bwrap does not isolate it; a key stored under a reused user id
  outlives the run, so one sample could leave answers for a later one.
- tracing and another process's memory or files (ptrace, process_vm_readv/writev, pidfd_getfd, kcmp): a test
  case could reach the harness that reports on it.
- new namespaces and mounts (unshare, setns, clone with CLONE_NEW*, mount and the new mount API, pivot_root,
  chroot, umount2): the sandbox's own layout must stay as built.
- kernel attack surface with no use here: io_uring, bpf, perf_event_open, userfaultfd, kexec, module loading,
  swap, reboot, acct, quotactl, syslog, open_by_handle_at, name_to_handle_at, iopl/ioperm, lookup_dcookie.
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import struct

# struct seccomp_data: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64)
_NR, _ARCH, _ARG0_LOW = 0, 4, 16
# classic BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45
_RET_K = 0x06
RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000


def ret_errno(code: int) -> int:
    return _RET_ERRNO | code


# clone(2) flags that make a new namespace: NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
NAMESPACE_FLAGS = 0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
NAMESPACE_FLAGS |= 0x20000000 | 0x40000000

DENIED = (
    "add_key",
    "request_key",
    "keyctl",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
    "syslog",
    "open_by_handle_at",
    "name_to_handle_at",
    "iopl",
    "ioperm",
    "lookup_dcookie",
)


class Arch:
    """One ABI: its AUDIT_ARCH value, its system call numbers, and the numbers above which its calls are another
    ABI's (x86-64's x32 calls carry bit 30)."""

    def __init__(self, audit_arch: int, numbers: dict[str, int], foreign_from: int | None) -> None:
        self.audit_arch, self.numbers, self.foreign_from = audit_arch, numbers, foreign_from


# From the kernel's syscall tables (arch/x86/entry/syscalls/syscall_64.tbl; include/uapi/asm-generic/unistd.h
# for arm64); tests/sandbox/test_seccomp.py checks them against libseccomp's tables where it is installed.
_NEW_MOUNT_API = {
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "clone3": 435,
}
X86_64 = Arch(
    0xC000003E,
    {
        **_NEW_MOUNT_API,
        "clone": 56,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "unshare": 272,
        "setns": 308,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "chroot": 161,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "kexec_load": 246,
        "kexec_file_load": 320,
        "init_module": 175,
        "finit_module": 313,
        "delete_module": 176,
        "swapon": 167,
        "swapoff": 168,
        "reboot": 169,
        "acct": 163,
        "quotactl": 179,
        "syslog": 103,
        "open_by_handle_at": 304,
        "name_to_handle_at": 303,
        "iopl": 172,
        "ioperm": 173,
        "lookup_dcookie": 212,
    },
    foreign_from=0x40000000,
)
AARCH64 = Arch(
    0xC00000B7,
    {
        **_NEW_MOUNT_API,
        "clone": 220,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "unshare": 97,
        "setns": 268,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "chroot": 51,
        "bpf": 280,
        "perf_event_open": 241,
        "userfaultfd": 282,
        "kexec_load": 104,
        "kexec_file_load": 294,
        "init_module": 105,
        "finit_module": 273,
        "delete_module": 106,
        "swapon": 224,
        "swapoff": 225,
        "reboot": 142,
        "acct": 89,
        "quotactl": 60,
        "syslog": 116,
        "open_by_handle_at": 265,
        "name_to_handle_at": 264,
        "lookup_dcookie": 18,
    },
    foreign_from=None,
)
ARCHES = {"x86_64": X86_64, "aarch64": AARCH64}


def this_arch() -> Arch | None:
    """The table of this machine's ABI, or None where the filter has none (the sandbox then runs without it
    and says so)."""
    return ARCHES.get(platform.machine())


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@functools.cache
def program(arch: Arch) -> bytes:
    """The filter as bwrap reads it: an array of ``struct sock_filter``.

    Layout: check the ABI; load the call number; calls of another ABI -> ENOSYS; each denied call -> EPERM;
    clone3 -> ENOSYS; clone with a namespace flag -> EPERM; everything else allowed."""
    denied = sorted({arch.numbers[name] for name in DENIED if name in arch.numbers})
    deny_eperm = ret_errno(errno.EPERM)
    body: list[bytes] = []
    # Jumps are relative to the next instruction and only go forward: each test jumps over the instructions
    # between it and its verdict, so the program is built from the end backwards.
    tail = [
        _insn(_LD_W_ABS, _ARG0_LOW),  # clone's flags (the low 32 bits hold every namespace flag)
        _insn(_JSET_K, NAMESPACE_FLAGS, jt=1, jf=0),
        _insn(_RET_K, RET_ALLOW),
        _insn(_RET_K, deny_eperm),
    ]
    # clone: fall into the flag check; anything else: allowed
    body = [_insn(_JEQ_K, arch.numbers["clone"], jt=1, jf=0), _insn(_RET_K, RET_ALLOW), *tail]
    body = [
        _insn(_JEQ_K, arch.numbers["clone3"], jt=0, jf=1),
        _insn(_RET_K, ret_errno(errno.ENOSYS)),
        *body,
    ]
    for number in reversed(denied):  # each: jump to the EPERM at the very end when it matches
        body = [_insn(_JEQ_K, number, jt=len(body) - 1, jf=0), *body]
    head = [_insn(_LD_W_ABS, _NR)]
    if arch.foreign_from is not None:
        head += [_insn(_JGE_K, arch.foreign_from, jt=0, jf=1), _insn(_RET_K, ret_errno(errno.ENOSYS))]
    start = [
        _insn(_LD_W_ABS, _ARCH),
        _insn(_JEQ_K, arch.audit_arch, jt=1, jf=0),
        _insn(_RET_K, ret_errno(errno.ENOSYS)),
    ]
    out = [*start, *head, *body]
    if len(out) > 4096:  # BPF_MAXINSNS
        raise AssertionError("seccomp program too long")
    return b"".join(out)


def program_fd(code: bytes) -> int:
    """A file descriptor holding ``code`` from its start (bwrap reads it to the end): one per run, since the
    read offset is shared by everyone holding the descriptor."""
    fd = os.memfd_create("posttrain-seccomp", 0)
    os.write(fd, code)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
