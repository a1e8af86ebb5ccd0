"""Running model-written code safely: a local bubblewrap sandbox, a SandboxFusion-compatible HTTP client and
server, and the pieces the code reward and the python tool share (see docs/sandbox.md)."""

from posttrain.sandbox.local import LocalSandbox
from posttrain.sandbox.types import STATUSES, Limits, RunRequest, RunResult

__all__ = ["STATUSES", "Limits", "LocalSandbox", "RunRequest", "RunResult"]
