"""Preference pairs from the built-in arithmetic task, for the reward-model demonstration.

Each problem gives one pair: the correct answer (chosen) and a wrong one (rejected): ``offset``, the true
result plus a nonzero offset of at most ``max_offset`` (a near miss); ``other``, the answer to another
problem; ``refusal``, "I do not know." (no arithmetic needed to rank it: a check of the pipeline). Training and validation problems come from the task's disjoint
splits (posttrain.data.tasks.arithmetic), so validation accuracy is measured on problems never trained on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from posttrain.data.tasks.arithmetic import make_arithmetic_splits

REJECTED_KINDS = ("offset", "other", "refusal")


def _rejected(kind: str, right: int, others: list[int], rng: random.Random, max_offset: int) -> str:
    if kind == "offset":  # a near miss: right + d, 0 < |d| <= max_offset
        return str(
            right + rng.choice([d for d in range(-max_offset, max_offset + 1) if d and right + d >= 0])
        )
    if kind == "other":  # the answer to another problem of the split
        return str(rng.choice([o for o in others if o != right]))
    return "I do not know."  # refusal: no arithmetic needed to tell it apart


def arithmetic_pairs(records, seed: int, kind: str = "offset", max_offset: int = 5) -> list[dict]:
    """One pair per problem: its correct answer (chosen) and a ``kind`` of wrong one (rejected)."""
    if kind not in REJECTED_KINDS:
        raise ValueError(f"kind={kind!r} must be one of {REJECTED_KINDS}")
    rng = random.Random(seed)
    others = [int(r.ground_truth) for r in records]
    rows = []
    for rec in records:
        right = int(rec.ground_truth)
        rejected = _rejected(kind, right, others, rng, max_offset)
        rows.append({"prompt": rec.prompt, "chosen": str(right), "rejected": rejected})
    return rows


def write_arithmetic_pairs(
    out_dir: str | Path, n_train: int, n_val: int, seed: int = 1, kind: str = "offset", max_offset: int = 5
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``val.jsonl`` pair files into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, val = make_arithmetic_splits(seed, n_train, n_val)
    paths = []
    for name, records, s in (("train", train, seed), ("val", val, seed + 1)):
        path = out_dir / f"{name}.jsonl"
        rows = arithmetic_pairs(records, s, kind, max_offset)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]
