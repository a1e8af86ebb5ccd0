"""Step-labelled arithmetic chains for the process-reward-model demonstration (TRL's stepwise format).

A chain adds numbers one at a time: the prompt lists them ("Add 3, 4, 5."), each step writes the running
sum ("3+4=7", then "7+5=12"). A chain has an error with probability ``p_error``: one step's result is off by
a nonzero amount of at most ``max_offset``; that step is labelled false. What follows it depends on
``after_error``:

- ``stop`` (PRM800K's and TRL's examples): the chain ends at its first wrong step, so every label is the check
  of its own step's sum.
- ``carry`` (Math-Shepherd's): the chain goes on from the wrong sum, each later step computed correctly from it
  and labelled false too (a right step on a wrong total), so the model must also follow the running total
  back to the prompt.

Held-out chains never share a prompt with a training or SFT chain: every list of numbers is either held out
or not (a hash of the numbers, the same for every seed), so held-out accuracy is measured on chains the PRM
and its start have not seen.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

AFTER_ERROR = ("stop", "carry")


def is_held_out(numbers: list[int], percent: int) -> bool:
    """Whether this list of numbers belongs to the held-out prompts (about ``percent`` % of all lists)."""
    digest = hashlib.sha256(",".join(map(str, numbers)).encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def arithmetic_chain(
    rng: random.Random,
    terms: int,
    max_operand: int,
    p_error: float,
    max_offset: int,
    after_error: str = "carry",
    held_out: bool | None = None,
    held_out_percent: int = 10,
) -> dict:
    """One stepwise row with ``terms`` operands in 1..max_operand; with ``held_out`` True or False, numbers
    drawn (again) until they are, or are not, a held-out prompt's."""
    numbers = [rng.randint(1, max_operand) for _ in range(terms)]
    while held_out is not None and is_held_out(numbers, held_out_percent) != held_out:
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
        if not ok and after_error == "stop":
            break
    return {"prompt": "Add " + ", ".join(map(str, numbers)) + ".\n", "completions": steps, "labels": labels}


def arithmetic_chains(
    n: int,
    seed: int,
    terms: int = 4,
    max_operand: int = 9,
    p_error: float = 0.5,
    max_offset: int = 3,
    after_error: str = "carry",
    held_out: bool | None = None,
    held_out_percent: int = 10,
) -> list[dict]:
    """``held_out``: None draws from every prompt; True only from the held-out ones; False from the others."""
    if held_out is not None and not 0 < held_out_percent < 100:
        raise ValueError(f"held_out_percent={held_out_percent}: both splits need prompts; use 1-99")
    rng = random.Random(seed)
    options = (terms, max_operand, p_error, max_offset, after_error, held_out, held_out_percent)
    return [arithmetic_chain(rng, *options) for _ in range(n)]


def sft_rows(n: int, seed: int, **options) -> list[dict]:
    """``n`` correct chains as SFT rows (prompt, the steps one per line): a start that adds, for the PRM. None
    has a held-out prompt."""
    chains = arithmetic_chains(n, seed, p_error=0.0, held_out=False, **options)
    return [{"prompt": c["prompt"], "response": "\n".join(c["completions"]) + "\n"} for c in chains]


def sum_problems(n: int, seed: int, held_out: bool, **prompts) -> list[dict]:
    """``n`` prompts of the chains' kind with their sum as the answer (``data.answer_key``): the GRPO task the
    PRM's dense reward is tried on. ``held_out`` as for :func:`arithmetic_chains`."""
    chains = arithmetic_chains(n, seed, p_error=0.0, held_out=held_out, **prompts)
    return [{"prompt": c["prompt"], "answer": c["completions"][-1].rsplit("=", 1)[1]} for c in chains]


def final_sum_reward(prompt, response, ground_truth, extra) -> float:  # noqa: ARG001 (the reward's signature)
    """The outcome reward of :func:`sum_problems`: 1 when the response's last step ends in the right sum."""
    steps = response.strip().split("\n")
    return 1.0 if "=" in steps[-1] and steps[-1].rsplit("=", 1)[1].strip() == ground_truth else 0.0


def write_chains(
    out_dir: str | Path, n_train: int, n_val: int, seed: int = 1, **options
) -> tuple[Path, Path]:
    """``train.jsonl`` (seed ``seed``, prompts not held out) and ``val.jsonl`` (seed ``seed + 1``, held-out
    prompts only) in ``out_dir``; their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, s, held_out in (("train", n_train, seed, False), ("val", n_val, seed + 1, True)):
        path = out_dir / f"{name}.jsonl"
        rows = arithmetic_chains(n, s, held_out=held_out, **options)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
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
        "--after-error",
        choices=AFTER_ERROR,
        default="carry",
        help="stop: a chain ends at its wrong step; carry: it goes on from the wrong sum, later steps false",
    )
    ap.add_argument("--held-out-percent", type=int, default=10, help="share of prompts kept for val.jsonl")
    ap.add_argument(
        "--sft", type=int, default=0, help="also write sft.jsonl: this many correct chains (seed + 2)"
    )
    args = ap.parse_args(argv)
    prompts = {
        "terms": args.terms,
        "max_operand": args.max_operand,
        "held_out_percent": args.held_out_percent,
    }
    options = {**prompts, "p_error": args.p_error, "after_error": args.after_error}
    for path in write_chains(args.out_dir, args.train, args.val, args.seed, **options):
        print(f"{path}: {sum(1 for _ in path.open())} chains")
    if args.sft:
        path = Path(args.out_dir) / "sft.jsonl"
        rows = sft_rows(args.sft, args.seed + 2, **prompts)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} correct chains for SFT")


if __name__ == "__main__":
    main()
