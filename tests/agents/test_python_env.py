"""The python code-interpreter tool in the multi-turn loop, through the real driver and the real bwrap sandbox:
`env.path=python` and a tool config naming the built-in tool; hostile code through the tool stays contained."""

import socket
import threading

import pytest

from posttrain.agents.build import environment_factory
from posttrain.agents.driver import Generation, run_trajectories
from posttrain.agents.hermes import tool_call_text
from posttrain.agents.python_tool import PythonEnv
from posttrain.config.load import build_config
from posttrain.sandbox.build import RunSandbox
from tests.helpers import multi_turn_settings

BIG = 123456789123456789 * 987654321987654321


@pytest.fixture
def quick(sandbox):  # `sandbox` (conftest) skips, or fails in CI, where no bwrap works
    return ["sandbox.time_limit_s=2", "sandbox.max_concurrent=2", "sandbox.memory_limit_mb=256"]


def config(*overrides):
    return build_config(overrides=["rollout.multi_turn.enable=true", *overrides])


def scripted(tok, code):
    """A policy that calls the python tool with ``code``, then answers with the last tool response."""

    def generate(requests):
        out = []
        for r in requests:
            seen = tok.decode(r.ids)
            if "<tool_response>" in seen:
                text = (
                    "The answer is "
                    + seen.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0].strip()
                )
            else:
                text = tool_call_text("python", {"code": code})
            reply = (tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[: r.max_tokens]
            out.append(Generation(reply, [0.0] * len(reply), "stop"))
        return out

    return generate


def play(tok, cfg, code, **settings):
    make_env = environment_factory(cfg)
    rows = [{"prompt": "What is 123456789123456789 * 987654321987654321?"}]
    return run_trajectories(rows, make_env, scripted(tok, code), tok, multi_turn_settings(**settings))[0]


def test_env_path_python_runs_the_call_in_the_sandbox(tok, quick):
    cfg = config("env.path=python", *quick)
    run_sandbox = RunSandbox(cfg.sandbox)
    make_env = environment_factory(cfg, run_sandbox)
    box = run_sandbox.get()
    first, second = make_env({}), make_env({})
    assert isinstance(first, PythonEnv) and box.limits.time_limit_s == 2.0
    # built once per run, not per environment or call
    assert first.tools["python"].fn.sandbox is second.tools["python"].fn.sandbox is box
    own = environment_factory(config("env.path=python", "rollout.multi_turn.tool_timeout_s=7", *quick))({})
    assert own.timeout_s == 7.0 and own.max_parallel_calls == 4
    assert (
        environment_factory(config("env.path=python", "env.kwargs.timeout_s=3", *quick))({}).timeout_s == 3.0
    )
    code = "print(123456789123456789 * 987654321987654321)"
    traj = play(tok, cfg, code, max_response_length=400)
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[2]["content"] == str(BIG)
    assert traj.messages[3]["content"].startswith(f"The answer is {BIG}")
    assert traj.metrics["tool_calls/python"] == 1.0


def test_the_schema_block_is_shown_unless_turned_off(quick):
    """A warm start trained without the block plays without it (rollout.multi_turn.render_tools=false); the
    environment keeps its tool either way (tests/agents/test_render_tools.py: the prompt without the block)."""
    shown = config("env.path=python", *quick)
    assert shown.rollout.multi_turn.render_tools
    assert [s["function"]["name"] for s in environment_factory(shown)({}).tool_schemas()] == ["python"]
    hidden = config("env.path=python", "rollout.multi_turn.render_tools=false", *quick)
    assert not hidden.rollout.multi_turn.render_tools


def test_python_from_a_tool_config(tok, quick, tmp_path):
    (tmp_path / "tools.yaml").write_text("tools:\n  - path: posttrain.agents.python_tool:python\n")
    cfg = config(f"rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}", *quick)
    traj = play(tok, cfg, "print(2 ** 200)\nimport sys; print('oops', file=sys.stderr); sys.exit(1)")
    assert traj.messages[2]["content"] == f"{2**200}\noops"  # stdout, then the error


def test_errors_and_long_output_are_truncated_by_the_loop(tok, quick):
    cfg = config("env.path=python", *quick)
    error = play(tok, cfg, "print('before')\n1/0", max_response_length=400).messages[2]["content"]
    assert error.startswith("before\nTraceback") and error.endswith("ZeroDivisionError: division by zero")
    long = play(tok, cfg, "print('x' * 100000)", max_tool_response_length=16).messages[2]["content"]
    assert len(tok(long, add_special_tokens=False)["input_ids"]) <= 24 and len(long) < 1000


def test_hostile_code_through_the_tool_is_contained(tok, quick):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    cfg = config("env.path=python", *quick)
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    reply = play(tok, cfg, code, max_response_length=4000).messages[2]["content"]
    assert "connected" not in reply.splitlines() and "Error" in reply and not accepted
    server.close()
    stuck = play(tok, cfg, "while True:\n    pass").messages[2]["content"]
    assert stuck == "[stopped: time limit of 2 s]"
