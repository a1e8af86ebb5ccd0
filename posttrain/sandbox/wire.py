"""SandboxFusion's `/run_code` JSON, both ways: a request from a :class:`RunRequest` and back, a response from
a :class:`RunResult` and back. Fields we add (``sandbox_status``) are extra keys other clients ignore."""

from __future__ import annotations

import base64
from typing import Any

from posttrain.sandbox.process import memory_signs_in
from posttrain.sandbox.types import (
    ERROR,
    FINISHED,
    LANGUAGES,
    MAX_FILES,
    MEMORY_LIMIT,
    SANDBOX_ERROR,
    SOURCE_NAMES,
    STATUSES,
    TIME_LIMIT,
    RunRequest,
    RunResult,
    file_name_problem,
    file_tree_problem,
)

MAX_FILES_BYTES = 32 * 1024 * 1024  # a request's `files`, decoded, in all


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


class RequestError(ValueError):
    """A `/run_code` body that fails validation: answered 422 with a FastAPI-style ``detail`` list, as
    SandboxFusion (a FastAPI app) answers a body its pydantic model refuses."""

    def __init__(self, loc: tuple[str, ...], msg: str) -> None:
        where = loc[0] + "".join(f"[{part!r}]" for part in loc[1:]) if loc else "the body"
        super().__init__(f"{where}: {msg}")
        self.loc, self.msg = loc, msg

    def detail(self) -> list[dict[str, Any]]:
        return [{"type": "value_error", "loc": ["body", *self.loc], "msg": self.msg}]


def request_from_json(body: Any) -> RunRequest:
    """A RunRequest from a `/run_code` body; a :class:`RequestError` when the body is malformed."""
    if not isinstance(body, dict):
        raise RequestError((), "a /run_code request is a JSON object")
    language = _string(body, "language", required=True)
    if language not in LANGUAGES:
        raise RequestError(("language",), f"unsupported language {language!r}; this server runs {LANGUAGES}")
    if body.get("fetch_files"):
        raise RequestError(("fetch_files",), "not supported by this server; print what you need instead")
    return RunRequest(
        code=_string(body, "code", required=True),
        language=language,
        stdin=_string(body, "stdin"),
        files=_files(body.get("files"), SOURCE_NAMES[language]),
        time_limit_s=_number(body, "run_timeout"),
        memory_limit_mb=_memory(body),
    )


def _string(body: dict, key: str, required: bool = False) -> str:
    value = body.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RequestError((key,), "required: a string" if value is None else "must be a string")
    _utf8((key,), value)
    return value


def _utf8(loc: tuple[str, ...], text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # JSON may hold a lone surrogate, which is no text
        raise RequestError(loc, "not valid UTF-8 text (a lone surrogate)") from None


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise RequestError((key,), f"must be a positive number of seconds, got {value!r}")
    return float(value)


def _memory(body: dict) -> int | None:
    """SandboxFusion's ``memory_limit_MB``: 0 or negative (its default, -1) is no limit of the request's own."""
    value = body.get("memory_limit_MB")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value % 1:
        raise RequestError(("memory_limit_MB",), f"must be a whole number of MiB, got {value!r}")
    return int(value) if value > 0 else None


def _files(files: Any, source: str) -> dict[str, bytes]:
    """SandboxFusion's ``files``: name -> base64 (a null content is skipped, as SandboxFusion does)."""
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise RequestError(("files",), "must map file names to base64 contents")
    if len(files) > MAX_FILES:
        raise RequestError(("files",), f"{len(files)} entries; at most {MAX_FILES}")
    out, total = {}, 0
    for name, content in files.items():
        if content is None:
            continue
        loc = ("files", name)
        check_file_name(name, source)
        if not isinstance(content, str):
            raise RequestError(loc, "must be a base64 string")
        try:
            out[name] = base64.b64decode(content)
        except ValueError as exc:  # binascii.Error, or non-ASCII characters
            raise RequestError(loc, f"not base64: {exc}") from None
        total += len(out[name])
        if total > MAX_FILES_BYTES:
            raise RequestError(("files",), f"over {MAX_FILES_BYTES} bytes decoded in all")
    _check_tree(out)
    return out


def check_file_name(name: str, source: str) -> None:
    """A 422 for a name the sandbox cannot create inside its directory (:func:`file_name_problem`)."""
    problem = file_name_problem(name, source)
    if problem:
        raise RequestError(("files", name), problem)


def _check_tree(files: dict[str, bytes]) -> None:
    problem = file_tree_problem(list(files))
    if problem:
        name, text = problem
        raise RequestError(("files", name) if name else ("files",), text)


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
