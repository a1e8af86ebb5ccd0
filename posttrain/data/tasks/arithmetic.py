"""Built-in arithmetic task: "What is 23 + 58?" → "81", generated locally from a seed.

Answer format: the response should be just the number. The reward takes the FIRST number in the
response (so "81", " 81\\n", "81<|im_end|>" and "81 is the answer" are all correct) and compares it to
the ground truth as an integer ("8", "810", "81.5" and "-81" are wrong). Taking the first number rather
than demanding an exact match keeps the signal dense for a tiny model, which learns the short format
within a few steps; restating the problem ("23 + 58 = 81") therefore scores 0, by design.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from typing import Any

from posttrain.config.errors import DataError
from posttrain.data.records import PromptRecord

OPS = ("+", "-")

# A number not preceded by a digit or a dot, with an optional sign and decimal part.
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:\.\d+)?")


def _operand_range(min_digits: int, max_digits: int, max_operand: int | None = None) -> range:
    """All integers with ``min_digits`` to ``max_digits`` digits (0 counts as one digit), up to ``max_operand``."""
    low = 0 if min_digits == 1 else 10 ** (min_digits - 1)
    high = 10**max_digits if max_operand is None else min(10**max_digits, max_operand + 1)
    if high <= low:
        raise DataError(f"max_operand={max_operand} leaves no operand with at least {min_digits} digit(s)")
    return range(low, high)


def _check_options(min_digits: int, max_digits: int, ops: Sequence[str]) -> None:
    if min_digits < 1:
        raise DataError(f"min_digits={min_digits} must be >= 1")
    if max_digits < min_digits:
        raise DataError(f"max_digits={max_digits} must be >= min_digits={min_digits}")
    if not ops:
        raise DataError(f"ops={ops!r} is empty; use e.g. ('+', '-')")
    for op in ops:
        if op not in OPS:
            raise DataError(f"ops contains {op!r}; supported operations are {OPS}")
    if len(set(ops)) != len(ops):
        raise DataError(f"ops={tuple(ops)!r} repeats an operation; list each once")


def _pairs_for(op: str, n: int, allow_negative: bool) -> int:
    """How many distinct operand pairs ``op`` has over ``n`` operand values."""
    if op == "-" and not allow_negative:
        return n * (n + 1) // 2  # a >= b only, so the answer is never negative
    return n * n


def _decode(index: int, op: str, operands: range, allow_negative: bool) -> tuple[int, int]:
    """Map a pair index in ``[0, _pairs_for(...))`` to its operands ``(a, b)``."""
    n = len(operands)
    if op == "-" and not allow_negative:
        # Triangular numbering of pairs (i, j) with j <= i.
        i = (math.isqrt(8 * index + 1) - 1) // 2
        j = index - i * (i + 1) // 2
        return operands[i], operands[j]
    i, j = divmod(index, n)
    return operands[i], operands[j]


def arithmetic_problem_count(
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = OPS,
    allow_negative: bool = False,
    max_operand: int | None = None,
) -> int:
    """Number of distinct problems with these options (an upper bound on ``n_train + n_val``)."""
    _check_options(min_digits, max_digits, ops)
    n = len(_operand_range(min_digits, max_digits, max_operand))
    return sum(_pairs_for(op, n, allow_negative) for op in ops)


def make_record(a: int, op: str, b: int) -> PromptRecord:
    """The record for ``a op b``."""
    answer = a + b if op == "+" else a - b
    return PromptRecord(
        prompt=f"What is {a} {op} {b}?",
        ground_truth=str(answer),
        extra={"task": "arithmetic", "a": a, "op": op, "b": b},
    )


def make_arithmetic_splits(
    seed: int,
    n_train: int,
    n_val: int,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = OPS,
    allow_negative: bool = False,
    max_operand: int | None = None,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Deterministic train and validation problems with no problem in both splits.

    Operands have ``min_digits``..``max_digits`` digits; ``ops`` picks from ``"+"`` and ``"-"``; with
    ``allow_negative=False`` subtraction is ordered so answers are never negative. The same arguments
    always give the same records.
    """
    if n_train < 1 or n_val < 0:
        raise DataError(f"need n_train >= 1 and n_val >= 0, got n_train={n_train}, n_val={n_val}")
    total = arithmetic_problem_count(min_digits, max_digits, ops, allow_negative, max_operand)
    if n_train + n_val > total:
        raise DataError(
            f"n_train + n_val = {n_train + n_val} exceeds the {total} distinct problems with "
            f"min_digits={min_digits}, max_digits={max_digits}, ops={tuple(ops)}; raise max_digits or ask for fewer"
        )
    operands = _operand_range(min_digits, max_digits, max_operand)
    sizes = [_pairs_for(op, len(operands), allow_negative) for op in ops]
    # Sampling indices of the problem space without replacement makes the splits disjoint by
    # construction; random.sample over a range never materialises the (possibly huge) space.
    picks = random.Random(seed).sample(range(total), n_train + n_val)
    records = [_record_at(index, ops, sizes, operands, allow_negative) for index in picks]
    return records[:n_train], records[n_train:]


def _record_at(
    index: int, ops: Sequence[str], sizes: list[int], operands: range, allow_negative: bool
) -> PromptRecord:
    for op, size in zip(ops, sizes):
        if index < size:
            a, b = _decode(index, op, operands, allow_negative)
            return make_record(a, op, b)
        index -= size
    raise AssertionError("problem index out of range")  # internal invariant: index < sum(sizes)


def first_number(text: str) -> int | float | None:
    """The first number in ``text`` (``"-12"`` → -12, ``"3.5"`` → 3.5), or None when there is none."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    number = match.group()
    # Integers stay exact ints: a float would round answers beyond 2**53.
    return float(number) if "." in number else int(number)


def arithmetic_reward(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """1.0 when the first number in ``response`` equals the integer ``ground_truth``, else 0.0."""
    if ground_truth is None:
        raise DataError("the arithmetic reward needs a ground_truth answer; the record has none")
    value = first_number(response)
    return 1.0 if value is not None and value == int(ground_truth) else 0.0


def load_arithmetic(
    seed: int,
    n_train: int = 10_000,
    n_val: int = 500,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = OPS,
    allow_negative: bool = False,
    max_operand: int | None = None,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Task-registry entry point: :func:`make_arithmetic_splits` with task defaults."""
    return make_arithmetic_splits(
        seed, n_train, n_val, min_digits, max_digits, ops, allow_negative, max_operand
    )
