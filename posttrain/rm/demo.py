"""Preference pairs from the built-in arithmetic task, for the reward-model demonstration.

Each problem gives pairs of its correct answer (chosen) and a wrong one (rejected): ``offset``, the true
result plus a nonzero offset of at most ``max_offset`` (a near miss); ``other``, the answer to another
problem; ``refusal``, "I do not know." (no arithmetic needed to rank it: a check of the pipeline). Training and validation problems come from the task's disjoint
splits (posttrain.data.tasks.arithmetic), so validation accuracy is measured on problems never trained on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from posttrain.config.load import build_config
from posttrain.data.splits import load_splits
from posttrain.data.tasks.arithmetic import make_arithmetic_splits

REJECTED_KINDS = ("offset", "other", "refusal")


def _offsets(right: int, rng: random.Random, max_offset: int, count: int) -> list[int]:
    """``count`` distinct near misses ``right + d``, 0 < |d| <= max_offset, never negative."""
    choices = [d for d in range(-max_offset, max_offset + 1) if d and right + d >= 0]
    return [right + d for d in rng.sample(choices, min(count, len(choices)))]


def _rejected(kind: str, right: int, others: list[int], rng: random.Random, max_offset: int, count: int):
    if kind == "offset":  # near misses
        return [str(r) for r in _offsets(right, rng, max_offset, count)]
    if kind == "other":  # answers to other problems of the split
        return [str(o) for o in rng.sample(sorted({o for o in others if o != right}), count)]
    return ["I do not know."]  # refusal: no arithmetic needed to tell it apart


def arithmetic_pairs(
    records, seed: int, kind: str = "offset", max_offset: int = 5, per_problem: int = 1
) -> list[dict]:
    """``per_problem`` pairs per problem (one for ``refusal``): its correct answer (chosen) and a ``kind`` of
    wrong one (rejected), each wrong answer different."""
    if kind not in REJECTED_KINDS:
        raise ValueError(f"kind={kind!r} must be one of {REJECTED_KINDS}")
    rng = random.Random(seed)
    others = [int(r.ground_truth) for r in records]
    rows = []
    for rec in records:
        right = int(rec.ground_truth)
        for rejected in _rejected(kind, right, others, rng, max_offset, per_problem):
            rows.append({"prompt": rec.prompt, "chosen": str(right), "rejected": rejected})
    return rows


def write_pairs(out_dir: str | Path, train, val, seed: int = 1, **options) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``val.jsonl`` pair files of the ``train`` and ``val`` problems into ``out_dir``
    (``options``: those of :func:`arithmetic_pairs`); returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, records, s in (("train", train, seed), ("val", val, seed + 1)):
        path = out_dir / f"{name}.jsonl"
        rows = arithmetic_pairs(records, s, **options)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def write_arithmetic_pairs(
    out_dir: str | Path, n_train: int, n_val: int, seed: int = 1, kind: str = "offset", max_offset: int = 5
) -> tuple[Path, Path]:
    """Pairs of ``n_train`` and ``n_val`` fresh problems (operands up to 99; disjoint splits)."""
    train, val = make_arithmetic_splits(seed, n_train, n_val)
    return write_pairs(out_dir, train, val, seed, kind=kind, max_offset=max_offset)


def write_task_pairs(out_dir: str | Path, overrides: list[str] = (), **options) -> tuple[Path, Path]:
    """Pairs of the built-in task's own problems (the splits `posttrain train` trains and validates on with
    the same data.* and trainer.seed ``overrides``)."""
    cfg = build_config(overrides=list(overrides))
    splits = load_splits(cfg)
    return write_pairs(out_dir, splits.train, splits.val, cfg.trainer.seed, **options)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m posttrain.rm.demo",
        description="Write preference pairs (train.jsonl, val.jsonl) from the built-in arithmetic task.",
    )
    ap.add_argument("out_dir")
    ap.add_argument("overrides", nargs="*", help="data.* / trainer.seed overrides of the task, as for train")
    ap.add_argument("--kind", default="offset", choices=REJECTED_KINDS, help="what the rejected answer is")
    ap.add_argument("--per-problem", type=int, default=10, help="pairs per problem (distinct wrong answers)")
    ap.add_argument("--max-offset", type=int, default=5, help="largest |wrong - right| of a near miss")
    args = ap.parse_args(argv)
    options = {"kind": args.kind, "per_problem": args.per_problem, "max_offset": args.max_offset}
    for path in write_task_pairs(args.out_dir, args.overrides, **options):
        print(f"{path}: {sum(1 for _ in path.open())} pairs")


if __name__ == "__main__":
    main()
