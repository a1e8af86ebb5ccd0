"""What a sandbox run is asked to do and what it returns (shared by every backend and the HTTP API)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from posttrain.config.schema.sandbox import SandboxConfig

FINISHED = "finished"  # exited on its own with exit code 0
ERROR = "error"  # exited on its own with another exit code (an exception, a syntax error, exit(3)...)
TIME_LIMIT = "time_limit"  # killed at the wall-clock limit, or by the CPU-time limit
MEMORY_LIMIT = "memory_limit"  # an allocation failed at the memory limit
OUTPUT_TRUNCATED = "output_truncated"  # printed more than the cap: killed, output cut at the cap
SANDBOX_ERROR = (
    "sandbox_error"  # the sandbox itself failed (a service unreachable after retries): not the code
)
STATUSES = (FINISHED, ERROR, TIME_LIMIT, MEMORY_LIMIT, OUTPUT_TRUNCATED, SANDBOX_ERROR)
LANGUAGES = ("python", "bash")
SOURCE_NAMES = {"python": "main.py", "bash": "main.sh"}  # the program's own file in the run's directory
# The files a run may bring (each is a descriptor handed to bwrap), the directories they may need, a name's
# length and depth; a component's length is the file system's limit.
MAX_FILES = 256
MAX_DIRECTORIES = 64
MAX_NAME_BYTES = 1024
MAX_NAME_DEPTH = 16
NAME_MAX = 255
HARNESS_START_S = 2.0  # a run of several executions: the harness's own start and bookkeeping


_SECTION = SandboxConfig()  # the `sandbox` section's defaults: declared there, once


@dataclass(frozen=True)
class Limits:
    """The limits of one execution: a frozen view of the `sandbox` section's limit keys (defaults: the
    section's own, not declared again here)."""

    time_limit_s: float = _SECTION.time_limit_s
    cpu_time_limit_s: float | None = _SECTION.cpu_time_limit_s
    memory_limit_mb: int = _SECTION.memory_limit_mb
    max_processes: int = _SECTION.max_processes
    max_file_size_mb: int = _SECTION.max_file_size_mb
    max_output_bytes: int = _SECTION.max_output_bytes
    max_disk_mb: int = _SECTION.max_disk_mb

    @classmethod
    def from_config(cls, cfg: SandboxConfig) -> Limits:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def cpu_seconds(self) -> int:
        return max(1, round(self.cpu_time_limit_s or self.time_limit_s))

    def describe(self) -> str:
        return (
            f"wall {self.time_limit_s:g} s, cpu {self.cpu_seconds} s, memory {self.memory_limit_mb} MiB, "
            f"{self.max_processes} processes, files {self.max_file_size_mb} MiB, /tmp {self.max_disk_mb} MiB, "
            f"output {self.max_output_bytes} bytes"
        )


@dataclass(frozen=True)
class RunRequest:
    """One program to run: its source, language, stdin and extra files (name -> bytes, put beside it).

    ``time_limit_s`` and ``memory_limit_mb`` override the sandbox's limits for this run (they may only lower
    a server's limits, never raise them). ``executions``: the program runs that many executions one after the
    other, each under the limits itself (the code reward's harness), so the run's wall-clock limit is that many
    times the sandbox's, plus :data:`HARNESS_START_S`. It is not part of the HTTP API: a service gives the whole
    run its own limit."""

    code: str
    language: str = "python"
    stdin: str = ""
    files: dict[str, bytes] = field(default_factory=dict)
    time_limit_s: float | None = None
    memory_limit_mb: int | None = None
    executions: int = 1

    def limits(self, base: Limits) -> Limits:
        out = base
        if self.executions > 1:
            out = replace(out, time_limit_s=base.time_limit_s * self.executions + HARNESS_START_S)
        if self.time_limit_s:
            out = replace(out, time_limit_s=min(self.time_limit_s, base.time_limit_s))
            if base.cpu_time_limit_s:
                out = replace(out, cpu_time_limit_s=min(base.cpu_time_limit_s, out.time_limit_s))
        if self.memory_limit_mb:
            out = replace(out, memory_limit_mb=min(self.memory_limit_mb, base.memory_limit_mb))
        return out


@dataclass(frozen=True)
class RunResult:
    """The outcome of one run. ``exit_code`` is None when the sandbox killed the program or never ran it."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.status == FINISHED


def file_name_problem(name: str, source: str) -> str | None:
    """What makes ``name`` unfit to be a file of a run whose program is ``source`` (None: fit): it must be a
    relative path of plain components (none empty, '.' or '..'), without NUL, within the length limits, and not
    the program's own file."""
    if "\x00" in name:
        return "a file name holds a NUL byte"
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:  # JSON may hold a lone surrogate, which is no text
        return "a file name that is not valid UTF-8 text (a lone surrogate)"
    if len(raw) > MAX_NAME_BYTES:
        return f"a file name of {len(raw)} bytes; at most {MAX_NAME_BYTES}"
    if name.startswith("/"):
        return "an absolute file name; use a name relative to the program's directory"
    parts = name.split("/")
    if len(parts) > MAX_NAME_DEPTH:
        return f"{len(parts)} path components; at most {MAX_NAME_DEPTH}"
    for part in parts:
        if part in ("", ".", ".."):
            return "empty, '.' and '..' path components are refused; write e.g. 'dir/f.txt'"
        if len(part.encode()) > NAME_MAX:
            return f"a path component of {len(part.encode())} bytes; at most {NAME_MAX}"
    if parts[0] == source:
        return f"{source!r} is the program's own file; choose another name"
    return None


def file_tree_problem(names: list[str]) -> tuple[str, str] | None:
    """(name, problem) when the files cannot all be created: one is also a directory of another (`a` beside
    `a/b`), or they need more than MAX_DIRECTORIES directories; None when they can."""
    if len(names) > MAX_FILES:
        return "", f"{len(names)} files; at most {MAX_FILES}"
    present, directories = set(names), set()
    for name in names:
        parent = name
        while "/" in parent:
            parent = parent.rsplit("/", 1)[0]
            if parent in present:
                return parent, f"is a file, and {name!r} needs it to be a directory"
            directories.add(parent)
    if len(directories) > MAX_DIRECTORIES:
        return "", f"{len(directories)} directories; at most {MAX_DIRECTORIES}"
    return None


def unsupported_language(request: RunRequest) -> RunResult | None:
    """The result of a request in a language no backend runs (a sandbox error, not the program's), else None:
    the one language check every backend makes before anything runs."""
    if request.language in LANGUAGES:
        return None
    return RunResult(SANDBOX_ERROR, None, "", f"unsupported language {request.language!r}; {LANGUAGES}", 0.0)
