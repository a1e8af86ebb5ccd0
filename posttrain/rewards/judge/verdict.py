"""Reading a judge's verdict: the text after the last ``VERDICT:`` marker of its answer, as a score in [0, 1].

Four kinds (a rubric criterion's ``verdict``):

- ``score``: a number in the criterion's range ``[low, high]``; read as ``(x - low) / (high - low)``. A number
  outside the range, or ``7/10`` style fractions whose denominator is not ``high``, is unparsed (a judge that
  answers out of range did not follow the rubric; clipping would hide it).
- ``grade``: a letter A, B, C, D or F (a trailing + or - is ignored); A=1, B=0.75, C=0.5, D=0.25, F=0.
- ``yes_no``: yes/true/pass = 1, no/false/fail = 0 (any case).
- ``choice`` (pairwise mode only): which of two responses shown is better, read as the score of the one shown
  first: ``A`` = 1, ``B`` = 0, ``tie`` = 0.5 (any case; also ``Response A`` / ``[[B]]``, and ``draw`` or
  ``equal`` for a tie). Anything else (``both``, ``A or B``) is unparsed; the pairwise scorer counts it and
  scores the comparison as a tie.

Only the LAST marker counts: a judge that quotes the response (which may itself hold a fake ``VERDICT: 10``)
before giving its own verdict is read at its own. Markdown emphasis and punctuation around the value are
ignored (``**VERDICT:** 8.``). Anything else (no marker, an empty value, two numbers) is None: the caller counts
it as ``reward/judge/unparsed`` and scores it with ``reward.judge.unparsed_score``.
"""

from __future__ import annotations

import math
import re

KINDS = ("score", "grade", "yes_no", "choice")
#: The kinds a pointwise criterion may use (``choice`` compares two responses).
POINTWISE_KINDS = ("score", "grade", "yes_no")
MARKER = "VERDICT:"
GRADES = {"A": 1.0, "B": 0.75, "C": 0.5, "D": 0.25, "F": 0.0}
YES = {"yes", "true", "pass"}
NO = {"no", "false", "fail"}
CHOICES = {"a": 1.0, "b": 0.0, "tie": 0.5, "draw": 0.5, "equal": 0.5}

_MARKER = re.compile(r"verdict\s*\**\s*:", re.IGNORECASE)
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_SCORE = re.compile(rf"^({_NUMBER})(?:\s*/\s*({_NUMBER}))?$")


def verdict_text(answer: str) -> str | None:
    """The value after the last ``VERDICT:`` marker (to the end of its line), stripped of markdown emphasis,
    quotes and closing punctuation; None when the answer has no marker."""
    found = list(_MARKER.finditer(answer))
    if not found:
        return None
    value = answer[found[-1].end() :].split("\n", 1)[0]
    return value.strip().strip("*_`\"' ").rstrip(".!;,").strip("*_`\"' ")


def parse_verdict(answer: str, kind: str, low: float = 0.0, high: float = 10.0) -> float | None:
    """The verdict of ``answer`` as a score in [0, 1], or None when it cannot be read (see the module doc)."""
    value = verdict_text(answer)
    if not value:
        return None
    if kind == "score":
        return _score(value, low, high)
    if kind == "grade":
        letter = value.rstrip("+-").upper()
        return GRADES.get(letter) if len(letter) == 1 else None
    if kind == "yes_no":
        word = value.lower()
        return 1.0 if word in YES else 0.0 if word in NO else None
    if kind == "choice":
        return _choice(value)
    raise ValueError(f"verdict kind {kind!r} is not one of {KINDS}")


def _score(value: str, low: float, high: float) -> float | None:
    match = _SCORE.match(value)
    if match is None:
        return None
    number = float(match.group(1))
    if match.group(2) is not None and float(match.group(2)) != high:
        return None  # "7/5" against a 0..10 rubric: the judge used another scale
    if not (math.isfinite(number) and low <= number <= high):
        return None
    return (number - low) / (high - low)


def _choice(value: str) -> float | None:
    word = value.strip("[]() ").lower()
    if word.startswith("response "):
        word = word[len("response ") :].strip()
    return CHOICES.get(word)
