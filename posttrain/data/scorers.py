"""Built-in scorers picked by a row's ``data_source``, as verl's default scorer picks them.

With no ``reward.function`` and data that has a ``data_source`` field (verl's layout), each response is scored
by the scorer registered for its row's source:

- ``openai/gsm8k``: the number after the last ``#### `` (strict, as verl's GSM8K scorer by default); the
  flexible variant (the last number anywhere) is the built-in reward ``gsm8k_flexible``.
- MATH-style answers (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``,
  DAPO's ``math_dapo``/``math``, and sources starting with ``aime``): the response's ``\\boxed{}`` (or last
  LaTeX/expression) compared with the ground truth by Hugging Face's ``math-verify`` (optional extra:
  ``pip install "posttrain[math]"``), so ``\\frac{1}{2}`` equals ``0.5`` and ``\\sqrt{8}`` equals
  ``2\\sqrt{2}``.
- code test cases (verl's ``codecontests``, ``apps``, ``codeforces``, ``taco``, and DeepCoder's
  ``primeintellect`` and ``livecodebench``): the response's program run against the row's test cases in the
  sandbox (the built-in ``code`` reward, ``posttrain.rewards.code``; the fraction of cases passed, as verl
  scores them). Those sources are named here (:data:`CODE_SOURCES`) and scored by the reward layer, which
  owns the sandbox.

Every scorer returns 1.0 or 0.0 and has posttrain's reward signature.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from posttrain.config.errors import ConfigError, DataError

_STRICT = re.compile(r"#### (-?[0-9.,$]+)")
_ANY_NUMBER = re.compile(r"-?[0-9.,]*[0-9]")
_TAIL = 300  # like verl: only the end of a long response is searched


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    text = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


def _same_number(predicted: str | None, ground_truth: str | None) -> float:
    if ground_truth is None:
        raise DataError("the GSM8K scorer needs a ground_truth answer; the row has none")
    got, want = _number(predicted), _number(ground_truth.strip())
    if got is None or want is None:
        return 1.0 if predicted is not None and predicted.strip() == ground_truth.strip() else 0.0
    return 1.0 if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9) else 0.0


def gsm8k_strict(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """1.0 when the number after the last ``#### `` equals ``ground_truth`` ("1,200" == "1200")."""
    found = _STRICT.findall(response[-_TAIL:])
    return _same_number(found[-1] if found else None, ground_truth)


def gsm8k_flexible(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """1.0 when the last number anywhere in the response equals ``ground_truth``."""
    found = _ANY_NUMBER.findall(response[-_TAIL:])
    return _same_number(found[-1] if found else None, ground_truth)


def math_verify_score(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """1.0 when math-verify finds the response's answer equal to ``ground_truth`` (LaTeX or plain)."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ConfigError(
            "MATH-style answers are checked with Hugging Face's math-verify: pip install 'posttrain[math]' "
            "(or pip install math-verify)"
        ) from exc
    if ground_truth is None:
        raise DataError("the math-verify scorer needs a ground_truth answer; the row has none")
    gold_text = ground_truth if ("$" in ground_truth or "\\boxed" in ground_truth) else f"${ground_truth}$"
    # The reward runner enforces reward.timeout_s; math-verify's own timeout needs the main thread.
    gold = parse(gold_text, parsing_timeout=None)
    answer = parse(response, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


Scorer = Callable[[str, str, "str | None", dict[str, Any]], float]

SCORERS: dict[str, Scorer] = {
    "openai/gsm8k": gsm8k_strict,
    "lighteval/MATH": math_verify_score,
    "DigitalLearningGmbH/MATH-lighteval": math_verify_score,
    "HuggingFaceH4/MATH-500": math_verify_score,
    "math_dapo": math_verify_score,
    "math": math_verify_score,
}
#: Sources whose ground truth is code test cases, scored in the sandbox by the reward layer.
CODE_SOURCES: tuple[str, ...] = (
    "codecontests",
    "apps",
    "codeforces",
    "taco",
    "primeintellect",
    "livecodebench",
)
#: Sources matched by their beginning (verl's AIME sets are named aime2024, aime2025, ...).
PREFIX_SCORERS: dict[str, Scorer] = {"aime": math_verify_score}


def scorer_for(data_source: str) -> Scorer | None:
    """The built-in scorer for ``data_source``, or None."""
    if data_source in SCORERS:
        return SCORERS[data_source]
    return next((fn for p, fn in PREFIX_SCORERS.items() if data_source.startswith(p)), None)


def check_data_sources(sources: Iterable[str], where: str) -> None:
    """A ConfigError, before any heavy work, when a source has no built-in scorer."""
    unknown = sorted({s for s in sources if scorer_for(s) is None and s not in CODE_SOURCES})
    if unknown:
        known = sorted(SCORERS) + [f"{p}*" for p in PREFIX_SCORERS] + [f"{c} (code)" for c in CODE_SOURCES]
        raise ConfigError(
            f"reward.function is empty and {where} has data_source {unknown}, which no built-in scorer knows "
            f"(known: {', '.join(known)}); pass your own: reward.function=path/to/file.py:compute_score "
            "(verl's compute_score(data_source, solution_str, ground_truth, extra_info) signature works)"
        )


def score_by_data_source(
    prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]
) -> float:
    """The score of the built-in scorer for the row's ``extra["data_source"]``."""
    source = extra.get("data_source")
    scorer = scorer_for(source) if isinstance(source, str) else None
    if scorer is None:
        check_data_sources([str(source)], "a row")
        raise AssertionError("unreachable")
    return scorer(prompt, response, ground_truth, extra)
