"""A fault for tests: kill one rank of a run at one step, from outside the process.

``POSTTRAIN_TEST_CRASH=RANK:STEP:PATH`` makes rank RANK exit at once with ``os._exit(1)`` (no cleanup, as a
killed process would) at the start of training step STEP, unless the file PATH exists; it creates PATH
first, so the job started again after the crash gets past that step. Tests use it where they cannot reach
into the process (a rank Ray placed). Unset (always, outside tests) it costs one environment lookup per step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

VARIABLE = "POSTTRAIN_TEST_CRASH"


def crash_if_asked(step: int, rank: int) -> None:
    spec = os.environ.get(VARIABLE)
    if not spec:
        return
    want_rank, want_step, path = spec.split(":", 2)
    if (int(want_rank), int(want_step)) != (rank, step) or Path(path).exists():
        return
    Path(path).touch()
    print(f"{VARIABLE}: rank {rank} exits at the start of step {step}", file=sys.stderr, flush=True)
    os._exit(1)
