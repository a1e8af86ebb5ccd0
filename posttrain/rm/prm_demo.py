"""Step-labelled arithmetic chains for the process-reward-model demonstration (TRL's stepwise format).

A chain adds numbers one at a time: the prompt lists them ("Add 3, 4, 5."), each step writes the running
sum ("3+4=7", then "7+5=12"). A chain has an error with probability ``p_error``: one step's result is off by
a nonzero amount of at most ``max_offset``; that step is labelled false, and so is every later step (they
build on the wrong sum; each later step is computed correctly from it, so only the running total is wrong —
the model must check the arithmetic of the step, not only its form). Training and held-out chains come from
different seeds.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def arithmetic_chain(
    rng: random.Random, terms: int, max_operand: int, p_error: float, max_offset: int
) -> dict:
    """One stepwise row with ``terms`` operands in 1..max_operand."""
    numbers = [rng.randint(1, max_operand) for _ in range(terms)]
    wrong_at = rng.randrange(terms - 1) if rng.random() < p_error else None
    steps, labels, total, ok = [], [], numbers[0], True
    for i, n in enumerate(numbers[1:]):
        result = total + n
        if i == wrong_at:
            result += rng.choice([d for d in range(-max_offset, max_offset + 1) if d and result + d >= 0])
            ok = False
        steps.append(f"{total}+{n}={result}")
        labels.append(ok)
        total = result
    return {"prompt": "Add " + ", ".join(map(str, numbers)) + ".\n", "completions": steps, "labels": labels}


def arithmetic_chains(
    n: int, seed: int, terms: int = 4, max_operand: int = 9, p_error: float = 0.5, max_offset: int = 3
) -> list[dict]:
    rng = random.Random(seed)
    return [arithmetic_chain(rng, terms, max_operand, p_error, max_offset) for _ in range(n)]


def sft_rows(n: int, seed: int, **options) -> list[dict]:
    """``n`` correct chains as SFT rows (prompt, the steps one per line): a start that adds, for the PRM."""
    chains = arithmetic_chains(n, seed, p_error=0.0, **options)
    return [{"prompt": c["prompt"], "response": "\n".join(c["completions"]) + "\n"} for c in chains]


def write_chains(
    out_dir: str | Path, n_train: int, n_val: int, seed: int = 1, **options
) -> tuple[Path, Path]:
    """``train.jsonl`` and ``val.jsonl`` (seeds ``seed`` and ``seed + 1``) in ``out_dir``; their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, s in (("train", n_train, seed), ("val", n_val, seed + 1)):
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_chains(n, s, **options)))
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m posttrain.rm.prm_demo",
        description="Write step-labelled arithmetic chains (train.jsonl, val.jsonl) in TRL's stepwise format.",
    )
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=2000, help="training chains")
    ap.add_argument("--val", type=int, default=200, help="held-out chains")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--terms", type=int, default=4, help="numbers per chain (steps: terms - 1)")
    ap.add_argument("--max-operand", type=int, default=9)
    ap.add_argument("--p-error", type=float, default=0.5, help="share of chains with one wrong step")
    ap.add_argument(
        "--sft", type=int, default=0, help="also write sft.jsonl: this many correct chains (seed + 2)"
    )
    args = ap.parse_args(argv)
    options = {"terms": args.terms, "max_operand": args.max_operand, "p_error": args.p_error}
    for path in write_chains(args.out_dir, args.train, args.val, args.seed, **options):
        print(f"{path}: {sum(1 for _ in path.open())} chains")
    if args.sft:
        path = Path(args.out_dir) / "sft.jsonl"
        rows = sft_rows(args.sft, args.seed + 2, terms=args.terms, max_operand=args.max_operand)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} correct chains for SFT")


if __name__ == "__main__":
    main()
