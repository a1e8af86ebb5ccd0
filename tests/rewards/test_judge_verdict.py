"""The judge's verdict parser (posttrain.rewards.judge.verdict): what reads as a score, and what is unparsed."""

import pytest

from posttrain.rewards.judge.verdict import parse_verdict


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("The answer is fine.\nVERDICT: 8", 0.8),
        ("VERDICT: 10", 1.0),
        ("VERDICT: 0", 0.0),
        ("verdict: 2.5", 0.25),
        ("**VERDICT:** 7.", 0.7),
        ("VERDICT: 7/10", 0.7),
        ("It says 'VERDICT: 10' but that is the response's text.\nVERDICT: 3", 0.3),  # the last marker counts
        ("no marker at all: 9", None),
        ("VERDICT:", None),
        ("VERDICT: eleven", None),
        ("VERDICT: 11", None),  # out of range: unparsed, not clipped
        ("VERDICT: -1", None),
        ("VERDICT: 7/5", None),  # another scale
        ("VERDICT: 7 or 8", None),
        ("VERDICT: nan", None),
    ],
)
def test_score_in_a_range(answer, expected):
    got = parse_verdict(answer, "score", 0, 10)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_score_range_other_than_0_to_10():
    assert parse_verdict("VERDICT: 3", "score", 1, 5) == pytest.approx(0.5)
    assert parse_verdict("VERDICT: 0", "score", 1, 5) is None


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("VERDICT: A", 1.0),
        ("VERDICT: b+", 0.75),
        ("VERDICT: C-", 0.5),
        ("VERDICT: D", 0.25),
        ("VERDICT: F", 0.0),
    ],
)
def test_letter_grades(answer, expected):
    assert parse_verdict(answer, "grade") == expected


@pytest.mark.parametrize("answer", ["VERDICT: E", "VERDICT: AB", "VERDICT: 9", "grade A"])
def test_unreadable_grades(answer):
    assert parse_verdict(answer, "grade") is None


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("VERDICT: yes", 1.0),
        ("VERDICT: YES.", 1.0),
        ("VERDICT: Pass", 1.0),
        ("VERDICT: no", 0.0),
        ("VERDICT: false", 0.0),
        ("VERDICT: maybe", None),
        ("yes", None),
    ],
)
def test_yes_no(answer, expected):
    assert parse_verdict(answer, "yes_no") == expected


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("VERDICT: A", 1.0),
        ("VERDICT: b", 0.0),
        ("VERDICT: tie", 0.5),
        ("verdict: Draw.", 0.5),
        ("VERDICT: equal", 0.5),
        ("**VERDICT:** Response A", 1.0),
        ("VERDICT: [[B]]", 0.0),
        ("B looks better, but VERDICT: A", 1.0),
        ("VERDICT: A or B", None),
        ("VERDICT: both", None),
        ("VERDICT: C", None),
        ("A", None),  # no marker
    ],
)
def test_choice_of_two_responses(answer, expected):
    """A choice reads as the score of the response shown first: A 1, B 0, a tie 0.5."""
    assert parse_verdict(answer, "choice") == expected
