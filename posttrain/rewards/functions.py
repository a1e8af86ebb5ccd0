"""Rule-based reward functions and how a config names one.

Every reward function is called as::

    fn(prompt: str, response: str, ground_truth: str | None, extra: dict) -> float

``extra`` is the record's other fields (``PromptRecord.extra``). A config names a built-in by its key in
:data:`REWARD_FUNCTIONS` or a user function as ``path/to/file.py:fn_name``. A user function may be written in
one of three styles, told apart by its signature (:func:`adapt_signature`): ours (positional, as above),
keyword style (``def reward(prompt=None, response="", ground_truth="", **kwargs)``, called with keywords), or
verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``; the last two are wrapped so
every caller sees the signature above.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.config.errors import ConfigError
from posttrain.data.scorers import (
    CODE_SOURCES,
    gsm8k_flexible,
    gsm8k_strict,
    math_verify_score,
    score_by_data_source,
)
from posttrain.data.tasks import calculator_reward, environment_reward
from posttrain.data.tasks.arithmetic import arithmetic_reward
from posttrain.data.tasks.gsm8k import gsm8k_reward
from posttrain.data.tasks.reasoning_gym import reasoning_gym_reward
from posttrain.rewards.code import CodeReward, code_reward_of
from posttrain.sandbox.build import RunSandbox
from posttrain.utils.user_code import function_of, import_file

RewardFn = Callable[[str, str, "str | None", dict[str, Any]], float]


def exact_match_reward(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """1.0 when ``response`` equals ``ground_truth`` after stripping surrounding whitespace, else 0.0."""
    if ground_truth is None:
        raise ConfigError("the exact_match reward needs a ground_truth answer; the record has none")
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


class DataSourceReward:
    """verl's default scorer: the built-in scorer for the row's ``data_source``; code sources
    (:data:`~posttrain.data.scorers.CODE_SOURCES`) run their test cases in the run's sandbox through ``code``
    (the `code` reward; `data_source_code` gives one, plain `data_source` none). A class, so it pickles."""

    def __init__(self, code: CodeReward | None = None) -> None:
        self.code = code

    def __call__(self, prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
        if extra.get("data_source") not in CODE_SOURCES:
            return score_by_data_source(prompt, response, ground_truth, extra)
        if self.code is None:
            raise ConfigError(
                f"a row's data_source {extra.get('data_source')!r} is a code source, whose test cases run in the "
                "sandbox: set reward.function=data_source_code (what posttrain picks for such data by itself)"
            )
        return self.code(prompt, response, ground_truth, extra)

    def samples_at_once(self) -> int:  # the code reward's: thread-safe, and slow enough to score in parallel
        return self.code.samples_at_once() if self.code is not None else 1


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact_match": exact_match_reward,
    "arithmetic": arithmetic_reward,
    "calculator": calculator_reward,
    "environment": environment_reward,  # a multi-turn run's environment rewards alone (e.g. guess_number)
    "gsm8k": gsm8k_reward,
    "gsm8k_strict": gsm8k_strict,
    "gsm8k_flexible": gsm8k_flexible,
    "math_verify": math_verify_score,
    "reasoning_gym": reasoning_gym_reward,
    "data_source": DataSourceReward(),  # the scorer registered for each row's data_source (verl's default)
}
# Built-ins that run code: they need the run's sandbox (resolve_reward_function's ``sandbox``).
SANDBOX_REWARD_NAMES = ("code", "data_source_code")
BUILT_IN_NAMES = sorted([*REWARD_FUNCTIONS, *SANDBOX_REWARD_NAMES])


def resolve_reward_function(
    spec: str | RewardFn, data_source: str = "", sandbox: RunSandbox | None = None
) -> RewardFn:
    """The reward function named by ``spec``: a key of :data:`REWARD_FUNCTIONS`, one of
    :data:`SANDBOX_REWARD_NAMES` (they run code in ``sandbox``, the run's), or ``file.py:fn_name``.

    A callable is returned unchanged, so code may pass a function directly. ``data_source`` is what a
    verl-style function receives as ``data_source`` when the record has no ``data_source`` field (the task
    or data file name).
    """
    if callable(spec):
        return spec
    if spec in SANDBOX_REWARD_NAMES:
        if sandbox is None:
            raise ValueError(f"reward function {spec!r} runs code: pass the run's sandbox")
        code = code_reward_of(sandbox.cfg.code_reward, sandbox.get())
        return code if spec == "code" else DataSourceReward(code)
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" not in spec:
        raise ConfigError(
            f"reward function {spec!r} is neither a built-in ({BUILT_IN_NAMES}) "
            "nor a user function written as 'path/to/file.py:function_name'"
        )
    # rsplit: the path part may itself contain ':' (a Windows drive letter).
    file_part, fn_name = spec.rsplit(":", 1)
    where = f"reward function {spec!r}"
    fn = function_of(import_file(Path(file_part), where), fn_name, where)
    return adapt_signature(fn, spec, data_source)


_OURS = ("prompt", "response", "ground_truth", "extra")
_VERL = ("data_source", "solution_str", "ground_truth", "extra_info")
STYLES = (
    "ours: fn(prompt, response, ground_truth, extra); "
    "keyword style: fn(prompt=None, response='', ground_truth='', **kwargs); "
    "verl's: compute_score(data_source, solution_str, ground_truth, extra_info)"
)


class KeywordReward:
    """A keyword-style function, called as ``fn(prompt=..., response=..., ground_truth=..., extra=...)``.
    A class, not a closure, so it pickles where workers are spawned rather than forked."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> Any:
        return self.fn(prompt=prompt, response=response, ground_truth=ground_truth, extra=extra)


class VerlReward:
    """verl's ``compute_score``: data_source is the record's ``data_source`` field, else the task or file
    name; solution_str is the response; extra_info is the row's own ``extra_info`` field when it has one (as
    verl passes it), else the record's other fields. Only the keywords the function declares are passed
    (older verl scorers take ``(solution_str, ground_truth)``). A reward in our style still sees every other
    field of the row in ``extra`` (``data_source``, ``ability``, ``reward_model``, ``extra_info``)."""

    def __init__(self, fn: Callable[..., Any], names: set[str], data_source: str) -> None:
        self.fn, self.names, self.data_source = fn, names, data_source

    def __call__(self, prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> Any:
        values = {
            "data_source": extra.get("data_source", self.data_source),
            "solution_str": response,
            "ground_truth": ground_truth,
            "extra_info": extra["extra_info"] if isinstance(extra.get("extra_info"), dict) else extra,
        }
        return self.fn(**{k: v for k, v in values.items() if k in self.names})


def adapt_signature(fn: Callable[..., Any], spec: str, data_source: str = "") -> RewardFn:
    """``fn`` callable as ``fn(prompt, response, ground_truth, extra)``, told from its signature; a
    ConfigError at start-up, not mid-run, when it fits none of the three styles."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # some builtins have no introspectable signature; the call itself will tell
    params = signature.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "solution_str" in params:
        try:
            signature.bind(**{k: None for k in _VERL if k in params or takes_kwargs})
            return VerlReward(fn, set(_VERL) if takes_kwargs else set(params), data_source)
        except TypeError:
            pass  # e.g. a required parameter verl does not pass; the error below lists the styles
    if _binds(signature, args=_OURS):
        return fn
    if _binds(signature, kwargs=_OURS):
        return KeywordReward(fn)
    raise ConfigError(
        f"reward function {spec!r} has signature {signature}, which fits none of the accepted styles "
        f"({STYLES}); change its parameters to one of them"
    )


def _binds(signature: inspect.Signature, args: tuple[str, ...] = (), kwargs: tuple[str, ...] = ()) -> bool:
    try:
        signature.bind(*args, **{k: None for k in kwargs})
    except TypeError:
        return False
    return True
