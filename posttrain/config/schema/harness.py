"""Agent harnesses (`harness.*`): the user's own agent loop, run once per trajectory against the policy served as
an OpenAI-compatible endpoint (the gateway); its calls' token ids become the trajectory (docs/harnesses.md)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import knob

PREFIX_BREAK_POLICIES = ("last", "fail")


@dataclass
class HarnessConfig:
    """An agent harness instead of posttrain's own agent loop: set `harness.path` or `harness.command` (not both)
    to roll out every trajectory through it; `env.path` and `rollout.multi_turn.enable` then stay unset."""

    path: str = knob(
        "",
        "'path/to/file.py:function': a Python callable (sync or async) called once per trajectory as "
        "fn(row, base_url, api_key); it returns a float reward, a dict {'reward': float, 'metrics': {...}}, or "
        "None (the reward function scores the final messages). Empty: no callable harness.",
    )
    command: str = knob(
        "",
        "A command run once per trajectory (split like a shell would, not run by one) with OPENAI_BASE_URL and "
        "OPENAI_API_KEY in its environment and the row as JSON on stdin; the last line of its stdout is its "
        "result as JSON (a number, an object as harness.path returns, or null). Empty: no command harness.",
    )
    timeout_s: float = knob(
        600.0,
        "Wall-clock seconds one trajectory's harness may take; then it counts as a harness failure of kind "
        "timeout (a command's whole process group is killed; the session refuses further calls).",
        min=0.01,
    )
    max_failures: int = knob(
        0,
        "Trajectories per rollout whose harness may fail (raised, exit, bad_output, timeout, no_calls, "
        "prefix_break) before the run stops; they are kept as stand-ins with no trained token and counted as "
        "gateway/harness_failures/<kind>. 0: the first failure stops the run, naming the row.",
        min=0,
    )
    max_concurrent: int = knob(
        32, "Trajectories whose harness runs at once (their model calls are batched together).", min=1
    )
    on_prefix_break: str = knob(
        "last",
        "A call whose prompt does not extend the previous call's prompt and completion (the harness rewrote "
        "its history) starts a new segment; last = train on the last segment only (the earlier ones are "
        "dropped and counted, gateway/prefix_breaks); fail = the trajectory is a harness failure of kind "
        "prefix_break.",
        choices=PREFIX_BREAK_POLICIES,
    )
    render_tools: bool = knob(
        True,
        "Render the tools a request declares into the prompt with the chat template (as an OpenAI server "
        "does). false: their calls are still read out of the answers, but the schemas stay out of the prompt, "
        "for a model that learned its tools' format in training (the built-in calculator warm start: the "
        "schema block is over 500 tokens of the tiny tokenizer).",
    )
    host: str = knob("127.0.0.1", "Interface the endpoint listens on (loopback by default).")
    port: int = knob(0, "Port the endpoint listens on; 0: a free port chosen at start.", min=0, max=65535)
    max_request_bytes: int = knob(
        4 << 20,
        "Largest request body the endpoint accepts; a larger one is refused (413).",
        unit="bytes",
        min=1,
    )


def harness_enabled(cfg: HarnessConfig) -> bool:
    """Whether trajectories are rolled out through a harness (`harness.path` or `harness.command` set)."""
    return bool(cfg.path or cfg.command)
