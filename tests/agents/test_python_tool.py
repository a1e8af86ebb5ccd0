"""run_python: what a code-interpreter tool hands back to the model."""

from posttrain.sandbox import Limits, LocalSandbox
from posttrain.sandbox.build import Sandbox
from posttrain.sandbox.run_python import run_python


def test_output_errors_and_limits_as_text(sandbox):
    box = Sandbox(sandbox, max_concurrent=1)
    assert run_python("print(2**100)", box) == str(2**100)
    assert run_python("x = 1", box) == "[no output]"
    error = run_python("print('before')\n1/0", box)
    assert error.startswith("before\nTraceback") and error.endswith("ZeroDivisionError: division by zero")
    quick = Sandbox(LocalSandbox(Limits(time_limit_s=1)), max_concurrent=1)
    assert run_python("import time; time.sleep(10)", quick) == "[stopped: time limit of 1 s]"
