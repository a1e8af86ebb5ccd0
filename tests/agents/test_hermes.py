"""The hermes format: parsing tool calls, failures as messages, concurrent execution."""

import asyncio
import time

from posttrain.agents.hermes import parse_tool_calls, run_calls, tool_call_text
from posttrain.agents.tools import ToolOutput, ToolSet, make_tool


async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "done"


def sleepy_sync(seconds: float) -> str:
    """Sleep in a thread, then answer."""
    time.sleep(seconds)
    return "done"


def boom(x: int) -> str:
    """Always raises."""
    raise RuntimeError(f"bad {x}")


def scored(x: int) -> ToolOutput:
    """Returns a reward contribution."""
    return ToolOutput(text=str(x * 2), reward=0.5)


TOOLS = ToolSet([make_tool(f) for f in (slow, sleepy_sync, boom, scored)])


def test_parse_tool_calls():
    text = (
        "thinking "
        + tool_call_text("scored", {"x": 2})
        + ' and <tool_call>{"name": "slow", "arguments": "{}"}'
    )
    calls = parse_tool_calls(text + "</tool_call>")
    assert [(c.name, c.arguments, c.error) for c in calls] == [("scored", {"x": 2}, None), ("slow", {}, None)]
    bad = parse_tool_calls(
        '<tool_call>{"name": "x", </tool_call><tool_call>[1]</tool_call><tool_call>{"name"'
    )
    assert len(bad) == 3 and all(c.error for c in bad)
    assert parse_tool_calls("no calls here") == []


def test_each_failure_kind_becomes_a_message_and_a_kind():
    text = (
        '<tool_call>{"name": "scored", "arguments": {</tool_call>'
        + tool_call_text("nope", {})
        + tool_call_text("scored", {"y": 1})
        + tool_call_text("scored", {"x": "two"})
        + tool_call_text("boom", {"x": 3})
        + tool_call_text("slow", {"seconds": 5})
        + tool_call_text("scored", {"x": 4})
    )
    results = asyncio.run(run_calls(parse_tool_calls(text), TOOLS, max_parallel_calls=4, timeout_s=0.3))
    kinds = [r.failure for r in results]
    assert kinds == ["malformed", "unknown_tool", "bad_arguments", "bad_arguments", "raised", "timeout", None]
    assert "not valid JSON" in results[0].text and "unknown tool 'nope'" in results[1].text
    assert "must be of type integer" in results[3].text and "RuntimeError: bad 3" in results[4].text
    assert "timed out after 0.3 s" in results[5].text
    assert (results[6].text, results[6].reward) == ("8", 0.5)


def test_32_trajectories_of_3_calls_run_concurrently():
    """32 x 3 calls of 0.2 s would take 19.2 s in sequence (async and thread-run sync tools alike)."""

    async def main(name):
        calls = parse_tool_calls(tool_call_text(name, {"seconds": 0.2}) * 3)
        return await asyncio.gather(*(run_calls(calls, TOOLS, 3, 5.0) for _ in range(32)))

    for name in ("slow", "sleepy_sync"):
        start = time.perf_counter()
        out = asyncio.run(main(name))
        elapsed = time.perf_counter() - start
        print(f"{name}: 32 trajectories x 3 calls of 0.2 s took {elapsed:.2f} s (19.2 s in sequence)")
        assert all(r.text == "done" for turn in out for r in turn)
        assert elapsed < 6.0


def test_max_parallel_calls_bounds_one_turn():
    calls = parse_tool_calls(tool_call_text("slow", {"seconds": 0.1}) * 4)
    start = time.perf_counter()
    asyncio.run(run_calls(calls, TOOLS, max_parallel_calls=1, timeout_s=5))
    assert time.perf_counter() - start >= 0.4


_HANGING_TOOL_SCRIPT = """
import asyncio, time
from posttrain.agents.hermes import parse_tool_calls, run_calls, tool_call_text
from posttrain.agents.tools import ToolSet, make_tool

def hang(seconds: float) -> str:
    '''Blocks its thread (no await point: it cannot be cancelled).'''
    time.sleep(seconds)
    return "late"

calls = parse_tool_calls(tool_call_text("hang", {"seconds": 60}))
results = asyncio.run(run_calls(calls, ToolSet([make_tool(hang)]), 1, timeout_s=0.2))
print(results[0].failure, flush=True)
"""


def test_a_timed_out_sync_tool_does_not_delay_the_exit(tmp_path):
    """The tool still sleeps 60 s when the script ends: its thread must not keep the process alive."""
    import os
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(_HANGING_TOOL_SCRIPT)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "timeout"
    assert elapsed < 20, f"the process took {elapsed:.1f} s to exit (the hung tool sleeps 60 s)"


class _Opaque:
    def __repr__(self) -> str:
        return "<Opaque object>"


def opaque() -> object:
    """Returns an object that JSON cannot encode."""
    return _Opaque()


def test_a_tool_result_json_cannot_encode_is_counted_and_sent_as_its_str():
    tools = ToolSet([make_tool(opaque)])
    results = asyncio.run(run_calls(parse_tool_calls(tool_call_text("opaque", {})), tools, 1, 5.0))
    assert results[0].failure == "unserializable"
    assert results[0].text == "<Opaque object>"  # what the model reads: the object's str()
