"""GSM8K-format math word problems from the user's own files, and their numeric verifier.

A file (``.jsonl``, ``.json``, ``.parquet`` or a saved ``datasets`` directory) has a ``question`` and an
``answer`` per row; the answer is a worked solution ending in ``#### 42``. The ground truth is the text
after the last ``####`` with thousands separators and dollar signs removed.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from posttrain.config.errors import DataError
from posttrain.data.datasets import load_records
from posttrain.data.records import PromptRecord

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# A number, optionally signed and dollar-prefixed, with "1,234"-style thousands groups and decimals;
# not the tail of a word or of another number.
_NUMBER = re.compile(r"(?<![\w.])-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _to_float(number: str) -> float:
    return float(number.replace(",", "").replace("$", ""))


def extract_final_answer(solution: str) -> str | None:
    """The number after the last ``####`` of a GSM8K solution, as plain digits ("1,200" → "1200")."""
    if "####" not in solution:
        return None
    tail = solution.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "")
    try:
        float(tail)
    except ValueError:
        return None
    return tail


def load_gsm8k(
    path: str | Path,
    instruction: str | None = GSM8K_INSTRUCTION,
    question_key: str = "question",
    answer_key: str = "answer",
) -> list[PromptRecord]:
    """Records from a GSM8K-format file; ``instruction`` (if any) is appended to each question.

    The full worked solution is kept in ``extra["solution"]``.
    """
    records = load_records(path, prompt_key=question_key, answer_key=answer_key)
    out = []
    for row, record in enumerate(records):
        where = f"{path}: row {row}"
        if not isinstance(record.prompt, str):
            raise DataError(f"{where}: field {question_key!r} must be a string question, got a message list")
        if record.ground_truth is None:
            raise DataError(f"{where}: field {answer_key!r} is missing; GSM8K rows need an answer")
        final = extract_final_answer(record.ground_truth)
        if final is None:
            raise DataError(
                f"{where}: field {answer_key!r} does not end in '#### <number>': {record.ground_truth[-80:]!r}"
            )
        prompt = f"{record.prompt}\n{instruction}" if instruction else record.prompt
        extra = {**record.extra, "task": "gsm8k", "solution": record.ground_truth}
        out.append(PromptRecord(prompt=prompt, ground_truth=final, extra=extra))
    return out


def load_gsm8k_task(
    seed: int,
    train_path: str | Path | None = None,
    val_path: str | Path | None = None,
    instruction: str | None = GSM8K_INSTRUCTION,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Task-registry entry point: train and validation records from the user's files.

    ``seed`` is unused (the files fix the data) but keeps the task signature uniform.
    """
    if train_path is None:
        raise DataError("the gsm8k task needs train_path: a .jsonl/.parquet file with question/answer rows")
    train = load_gsm8k(train_path, instruction)
    val = load_gsm8k(val_path, instruction) if val_path is not None else []
    return train, val


def final_number(response: str) -> float | None:
    """The answer a response commits to: the first number after the last ``####`` if there is one,
    otherwise the last number in the response; None when there is no number."""
    if "####" in response:
        match = _NUMBER.search(response.rsplit("####", 1)[1])
        return _to_float(match.group()) if match else None
    numbers = _NUMBER.findall(response)
    return _to_float(numbers[-1]) if numbers else None


def gsm8k_reward(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """1.0 when the response's final number equals ``ground_truth`` numerically ("18.00" == "18")."""
    if ground_truth is None:
        raise DataError("the gsm8k reward needs a ground_truth answer; the record has none")
    expected = _to_float(ground_truth.strip())
    predicted = final_number(response)
    if predicted is None:
        return 0.0
    return 1.0 if math.isclose(predicted, expected, rel_tol=1e-9, abs_tol=1e-9) else 0.0
