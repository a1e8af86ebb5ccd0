"""Preference pairs from the built-in arithmetic task, for the reward-model demonstration.

Each problem gives one pair: the correct answer (chosen) and a wrong one (rejected), the true result plus a
nonzero offset of at most ``max_offset``. Training and validation problems come from the task's disjoint
splits (posttrain.data.tasks.arithmetic), so validation accuracy is measured on problems never trained on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from posttrain.data.tasks.arithmetic import make_arithmetic_splits


def arithmetic_pairs(records, seed: int, max_offset: int = 5) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for rec in records:
        right = int(rec.ground_truth)
        offset = rng.choice([d for d in range(-max_offset, max_offset + 1) if d and right + d >= 0] or [1])
        rows.append({"prompt": rec.prompt, "chosen": str(right), "rejected": str(right + offset)})
    return rows


def write_arithmetic_pairs(
    out_dir: str | Path, n_train: int, n_val: int, seed: int = 1, max_offset: int = 5
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``val.jsonl`` pair files into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, val = make_arithmetic_splits(seed, n_train, n_val)
    paths = []
    for name, records, s in (("train", train, seed), ("val", val, seed + 1)):
        path = out_dir / f"{name}.jsonl"
        rows = arithmetic_pairs(records, s, max_offset)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]
