"""The sandbox side of a `python` code-interpreter tool: code in, the text a model should see out.

The multi-turn loop truncates the text in tokens; this only shapes it: stdout, then stderr (the error), then a
note when the run did not finish (time or memory limit, cut output)."""

from __future__ import annotations

from posttrain.sandbox.build import Sandbox
from posttrain.sandbox.types import ERROR, FINISHED, OUTPUT_TRUNCATED, RunRequest

NOTES = {
    "time_limit": "[stopped: time limit of {limit:g} s]",
    "memory_limit": "[stopped: memory limit of {memory} MiB]",
    OUTPUT_TRUNCATED: "[output cut: more than {output} bytes]",
    "sandbox_error": "[the sandbox failed: {stderr}]",
}


def run_python(code: str, sandbox: Sandbox) -> str:
    """Run ``code`` in ``sandbox``; the output, the error and any limit hit, as one text (never raises for the
    code's doings)."""
    result = sandbox.run(RunRequest(code))
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip() and result.status != "sandbox_error":
        parts.append(result.stderr.rstrip("\n"))
    if result.status not in (FINISHED, ERROR):
        limits = sandbox.limits
        note = NOTES[result.status].format(
            limit=limits.time_limit_s,
            memory=limits.memory_limit_mb,
            output=limits.max_output_bytes,
            stderr=result.stderr.strip()[:200],
        )
        parts.append(note)
    return "\n".join(parts) if parts else "[no output]"
