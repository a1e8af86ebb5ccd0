"""`posttrain explain`'s multi-turn plan: turns, the trajectory token budget, the environment, every tool; or,
with a harness (`harness.*`), the harness's plan."""

from __future__ import annotations

import inspect
import json
from typing import Any

from rich.tree import Tree

from posttrain.agents.build import SKYRL, load_tools, resolve_env
from posttrain.agents.check import sample_environment
from posttrain.agents.render import Renderer
from posttrain.agents.tools import ToolSet
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.harness import harness_enabled
from posttrain.config.schema.names import TASK_ENVIRONMENTS
from posttrain.planning.rm_plan import run_tokenizer


def multi_turn_plan(cfg: PostTrainConfig) -> dict[str, Any] | None:
    """The plan as data (explain --json), or None when multi-turn rollouts are off."""
    mt, env = cfg.rollout.multi_turn, cfg.env
    if harness_enabled(cfg.harness):
        return harness_plan(cfg)
    if not mt.enable:
        return None
    spec = resolve_env(env.path)
    schemas: list[dict[str, Any]] = []
    unlisted: list[str] = []  # tools the environment answers whose schemas stay out of the prompt
    if spec.kind != SKYRL:
        made = sample_environment(cfg)
        schemas = (made.tool_schemas() or []) if mt.render_tools else []
        listed = {s.get("function", {}).get("name") for s in schemas}
        tools = getattr(made, "tools", None)
        if isinstance(tools, ToolSet):
            unlisted = [name for name in tools.tools if name not in listed]
        made.close()
    block = tool_block_tokens(cfg, schemas)
    return {
        "implied_by_task": cfg.data.task if cfg.data.task in TASK_ENVIRONMENTS else None,
        "tool_block_tokens": block,
        "max_sequence_tokens": None
        if block is None
        else cfg.data.max_prompt_length + block + cfg.data.max_response_length,
        "warnings": budget_warnings(cfg),
        "max_assistant_turns": mt.max_assistant_turns,
        "max_user_turns": mt.max_user_turns,
        "trajectory_budget_tokens": cfg.data.max_response_length,
        "max_tokens_per_turn": mt.max_tokens_per_turn or None,
        "max_tool_response_length": mt.max_tool_response_length,
        "environment": spec.name,
        "environment_kwargs": _kwargs_with_defaults(spec, env.kwargs),
        "tools": schemas,
        "tools_not_in_prompt": unlisted,
    }


def tool_block_tokens(cfg: PostTrainConfig, schemas: list[dict[str, Any]]) -> int | None:
    """How many tokens the chat template's tool schema block adds to every prompt (0: no tools listed; None:
    unknown, the model's tokenizer is not here, as with `explain --model-config`). The data's prompt length
    limit does not see it: the block is rendered with the prompt, per trajectory."""
    if not schemas:
        return 0
    try:
        tokenizer = run_tokenizer(cfg)
    except (ConfigError, OSError):  # no model directory here: explain plans without it
        return None
    if not getattr(tokenizer, "chat_template", None):
        return 0
    probe = [{"role": "user", "content": "hi"}]
    with_tools = Renderer(tokenizer, tools=schemas).prompt_ids(probe)
    return len(with_tools) - len(Renderer(tokenizer).prompt_ids(probe))


def budget_warnings(cfg: PostTrainConfig) -> list[str]:
    """Limits that cannot all hold: a tool result allowed more tokens than the whole trajectory has."""
    mt, budget = cfg.rollout.multi_turn, cfg.data.max_response_length
    if mt.max_tool_response_length <= budget:
        return []
    return [
        f"rollout.multi_turn.max_tool_response_length={mt.max_tool_response_length} exceeds the trajectory's "
        f"budget data.max_response_length={budget}: one long tool result ends the trajectory (its tokens count "
        f"against the budget); lower max_tool_response_length below {budget} or raise data.max_response_length"
    ]


def _kwargs_with_defaults(spec: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`env.kwargs` with the constructor's defaults for the rest (SkyRL: env_config as given)."""
    if spec.cls is None:
        return dict(kwargs)
    try:
        bound = inspect.signature(spec.cls).bind_partial(**kwargs)
    except (TypeError, ValueError):
        return dict(kwargs)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k not in ("args", "kwargs")}


def multi_turn_tree(cfg: PostTrainConfig) -> Tree | None:
    """The plan as explain prints it (None when multi-turn rollouts are off)."""
    plan = multi_turn_plan(cfg)
    if plan is None:
        return None
    if "harness" in plan:
        return harness_tree(plan)
    mt = cfg.rollout.multi_turn
    why = f"implied by data.task={plan['implied_by_task']}" if plan["implied_by_task"] else "on"
    root = Tree(f"multi-turn rollouts (rollout.multi_turn.enable: {why}; format {mt.format})")
    root.add(
        f"turns: at most {mt.max_assistant_turns} assistant turns (rollout.multi_turn.max_assistant_turns) and "
        f"{mt.max_user_turns} environment replies (rollout.multi_turn.max_user_turns) per trajectory"
    )
    budget = root.add(
        f"trajectory budget: data.max_response_length={cfg.data.max_response_length} tokens after the prompt, "
        "shared by the assistant turns and the environment replies; the trajectory ends when it is spent"
    )
    per_turn = (
        f"at most {mt.max_tokens_per_turn} tokens (rollout.multi_turn.max_tokens_per_turn) or what is left"
        if mt.max_tokens_per_turn
        else "what is left of the budget (rollout.multi_turn.max_tokens_per_turn=0)"
    )
    budget.add(f"one assistant turn samples {per_turn}")
    budget.add(
        f"one tool result keeps at most {mt.max_tool_response_length} tokens "
        f"(rollout.multi_turn.max_tool_response_length; tool_response_truncate_side={mt.tool_response_truncate_side})"
    )
    if plan["tool_block_tokens"]:
        p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
        budget.add(
            f"prompt: the tool schema block adds {plan['tool_block_tokens']} tokens to every prompt, beyond "
            f"data.max_prompt_length={p}: sequences reach {plan['max_sequence_tokens']} tokens ({p} prompt + "
            f"{plan['tool_block_tokens']} tool schemas + {r} response)"
        )
    elif plan["tool_block_tokens"] is None:
        budget.add(
            "prompt: the tool schema block adds tokens to every prompt, beyond data.max_prompt_length (how many "
            "needs the model's tokenizer, which is not here)"
        )
    for warning in plan["warnings"]:
        budget.add(f"[bold yellow]warning[/]: {warning}")
    budget.add(
        "assistant tokens count against the budget and are trained on; environment tokens (tool results, user "
        "replies and the chat template's text between turns) count against the budget but are masked out of "
        "the loss"
    )
    kwargs = ", ".join(f"{k}={v!r}" for k, v in plan["environment_kwargs"].items())
    root.add(f"environment: {plan['environment']}({kwargs}) (env.path={cfg.env.path!r}, env.kwargs)")
    _tools_branch(root, cfg, plan["tools"], plan["tools_not_in_prompt"])
    placement = {
        "final": "summed onto the trajectory's last token",
        "per_turn": "each on the last token of its assistant turn",
    }[mt.turn_rewards]
    root.add(
        f"rewards: the environment's per-turn rewards are {placement} (rollout.multi_turn.turn_rewards="
        f"{mt.turn_rewards}); environments that may fail per step: {mt.max_env_failures} "
        "(rollout.multi_turn.max_env_failures)"
    )
    return root


def _tools_branch(
    root: Tree, cfg: PostTrainConfig, schemas: list[dict[str, Any]], unlisted: list[str]
) -> None:
    mt = cfg.rollout.multi_turn
    if unlisted:
        why = "rollout.multi_turn.render_tools=false" if not mt.render_tools else "the environment lists none"
        root.add(
            f"tools the environment answers without listing them in the prompt: {', '.join(unlisted)} "
            f"({why}: the model learns the call format from its warm start)"
        )
    if not schemas:
        if not unlisted:
            root.add("tools: none")
        return
    source = f"tool config {mt.tool_config_path!r}" if mt.tool_config_path else "the environment's"
    tools = root.add(
        f"tools ({len(schemas)}, {source}; at most {mt.max_parallel_calls} calls at once, "
        f"{mt.tool_timeout_s:g} s each unless the tool sets its own):"
    )
    timeouts = {name: tool.timeout_s for name, tool in load_tools(cfg).tools.items() if tool.timeout_s}
    for schema in schemas:
        name = schema.get("function", {}).get("name", "?")
        own = f" (timeout {timeouts[name]:g} s)" if name in timeouts else ""
        tools.add(f"{name}{own}: {json.dumps(schema, sort_keys=True)}")


def harness_plan(cfg: PostTrainConfig) -> dict[str, Any]:
    """A harness run's plan as data: the harness, its endpoint and limits (docs/harnesses.md)."""
    h, mt = cfg.harness, cfg.rollout.multi_turn
    return {
        "harness": f"harness.path={h.path!r}" if h.path else f"harness.command={h.command!r}",
        "endpoint": f"http://{h.host}:{h.port or '<free port>'}/s/<session>/v1",
        "max_concurrent": h.max_concurrent,
        "timeout_s": h.timeout_s,
        "max_failures": h.max_failures,
        "on_prefix_break": h.on_prefix_break,
        "trajectory_budget_tokens": cfg.data.max_response_length,
        "max_tokens_per_turn": mt.max_tokens_per_turn or None,
        "turn_rewards": mt.turn_rewards,
    }


def harness_tree(plan: dict[str, Any]) -> Tree:
    root = Tree(f"harness rollouts ({plan['harness']}): one run per trajectory against {plan['endpoint']}")
    root.add(
        f"at most {plan['max_concurrent']} at once (harness.max_concurrent), {plan['timeout_s']} s each "
        f"(harness.timeout_s); failures allowed per rollout: {plan['max_failures']} (harness.max_failures)"
    )
    per_call = plan["max_tokens_per_turn"] or "what is left"
    root.add(
        f"trajectory budget: data.max_response_length={plan['trajectory_budget_tokens']} tokens after the first "
        f"prompt; one call samples at most {per_call} (rollout.multi_turn.max_tokens_per_turn)"
    )
    root.add(
        "trained: the sampled ids of a chain of calls that extend each other (mask 1), the template tokens "
        f"between them masked out; a rewritten history: harness.on_prefix_break={plan['on_prefix_break']}"
    )
    root.add(
        "rewards: a harness's reward replaces the reward function's score; None leaves it to the function"
    )
    return root
