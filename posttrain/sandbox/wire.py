"""SandboxFusion's `/run_code` JSON, both ways: a request from a :class:`RunRequest` and back, a response from
a :class:`RunResult` and back. Fields we add (``sandbox_status``) are extra keys other clients ignore."""

from __future__ import annotations

import base64
from typing import Any

from posttrain.config.errors import ConfigError
from posttrain.sandbox.process import memory_signs_in
from posttrain.sandbox.types import (
    ERROR,
    FINISHED,
    MEMORY_LIMIT,
    SANDBOX_ERROR,
    STATUSES,
    TIME_LIMIT,
    RunRequest,
    RunResult,
)


def request_to_json(request: RunRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "code": request.code,
        "language": request.language,
        "stdin": request.stdin,
        "compile_timeout": request.time_limit_s or 10,
        "files": {name: base64.b64encode(data).decode() for name, data in request.files.items()},
    }
    if request.time_limit_s:
        payload["run_timeout"] = request.time_limit_s
    if request.memory_limit_mb:
        payload["memory_limit_MB"] = request.memory_limit_mb
    return payload


def request_from_json(body: Any) -> RunRequest:
    """A RunRequest from a `/run_code` body; a ConfigError (answered as 400) when the body is malformed."""
    if not isinstance(body, dict) or not isinstance(body.get("code"), str):
        raise ConfigError("a /run_code request is a JSON object with a string 'code'")
    files = body.get("files") or {}
    if not isinstance(files, dict):
        raise ConfigError("'files' must map file names to base64 contents")
    try:
        decoded = {str(k): base64.b64decode(v) for k, v in files.items()}
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"'files' holds a value that is not base64: {exc}") from None
    return RunRequest(
        code=body["code"],
        language=str(body.get("language") or "python"),
        stdin=str(body.get("stdin") or ""),
        files=decoded,
        time_limit_s=_number(body, "run_timeout"),
        memory_limit_mb=int(_number(body, "memory_limit_MB") or 0) or None,
    )


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{key!r} must be a positive number, got {value!r}")
    return float(value)


def response_to_json(result: RunResult) -> dict[str, Any]:
    run_status = {TIME_LIMIT: "TimeLimitExceeded", SANDBOX_ERROR: "Error"}.get(result.status, "Finished")
    top = (
        "Success"
        if result.status == FINISHED
        else "SandboxError"
        if result.status == SANDBOX_ERROR
        else "Failed"
    )
    return {
        "status": top,
        "message": "" if result.status == FINISHED else result.status,
        "compile_result": None,
        "run_result": {
            "status": run_status,
            "execution_time": result.duration_s,
            "return_code": result.exit_code,
            "stdout": result.stdout,
            "stderr": result.stderr,
            "sandbox_status": result.status,
        },
        "files": {},
    }


def response_from_json(body: Any, duration_s: float) -> RunResult:
    """A RunResult from a `/run_code` answer of posttrain's server or of SandboxFusion itself."""
    if not isinstance(body, dict):
        return RunResult(SANDBOX_ERROR, None, "", f"malformed answer: {str(body)[:200]}", duration_s)
    run = body.get("run_result") or {}
    compiled = body.get("compile_result") or {}
    if not run:  # SandboxFusion: a compile error, or its own failure
        status = SANDBOX_ERROR if body.get("status") == "SandboxError" else ERROR
        text = str(compiled.get("stderr") or body.get("message") or "")
        return RunResult(status, compiled.get("return_code"), "", text, duration_s)
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    code = run.get("return_code")
    status = run.get("sandbox_status")
    if status not in STATUSES:
        if run.get("status") == "TimeLimitExceeded":
            status = TIME_LIMIT
        elif code == 0 and run.get("status") == "Finished":
            status = FINISHED
        else:
            status = MEMORY_LIMIT if memory_signs_in(stderr) else ERROR
    elapsed = run.get("execution_time")
    return RunResult(status, code, stdout, stderr, float(elapsed) if elapsed is not None else duration_s)
