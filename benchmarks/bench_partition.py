"""Micro-batch planning and DP balancing: posttrain's planners vs a naive split and a verl-style baseline.

Run: ``python benchmarks/bench_partition.py`` (about half a minute on 2 CPU cores).

Part 1, token-budget micro-batches (per rank): for each setting, ``--trials`` random batches are planned by
  * posttrain ``plan_token_micro_batches`` (hard cap, minimal count, balanced),
  * a naive count split: ``floor(budget / max_len)`` sequences per micro-batch in batch order, ``max_len``
    being the longest sequence the distribution can produce (the fixed micro-batch size that is safe),
  * the verl-style ``rearrange_micro_batches`` reproduction (count ``ceil(total / budget)``, KK balance on
    verl's workload model, no cap check), and the same on raw token counts (older releases), see
    ``benchmarks/verl_reference.py``.
  Reported: mean micro-batch count, mean and worst max/mean token load, and how many micro-batches (over
  all trials) exceed the budget, with the worst overflow.

Part 2, DP balancing: ``balance_batch`` vs verl-style Karmarkar–Karp (equal sizes), max/mean token load
per rank, mean and worst over trials.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_reference import verl_kk_partitions, verl_rearrange_micro_batches  # noqa: E402

from posttrain.batching.balance import balance_batch, partition_stats  # noqa: E402
from posttrain.batching.token_budget import plan_token_micro_batches  # noqa: E402

MAX_PROMPT, MAX_RESPONSE = 300, 1024
MAX_LEN = MAX_PROMPT + MAX_RESPONSE


def rl_lengths(rng: random.Random, n: int, sigma: float = 1.0) -> list[int]:
    """Prompt 50-300 tokens + lognormal response (median ~245) truncated at max_response_length."""
    return [
        rng.randint(50, MAX_PROMPT) + min(MAX_RESPONSE, int(rng.lognormvariate(5.5, sigma))) for _ in range(n)
    ]


def long_tail_lengths(rng: random.Random, n: int) -> list[int]:
    """Reasoning-style rollouts: a third of the responses hit the length limit."""
    return [
        rng.randint(50, MAX_PROMPT) + (MAX_RESPONSE if rng.random() < 0.33 else rng.randint(20, MAX_RESPONSE))
        for _ in range(n)
    ]


def half_budget_lengths(rng: random.Random, n: int, budget: int) -> list[int]:
    """Adversarial: every sequence just over half the budget, so no two fit together."""
    return [budget // 2 + rng.randint(1, budget // 16) for _ in range(n)]


def loads(lens: list[int], plan: list[list[int]]) -> list[int]:
    return [sum(lens[i] for i in mb) for mb in plan]


def naive_split(lens: list[int], budget: int, max_len: int) -> list[list[int]]:
    per = max(1, budget // max_len)
    return [list(range(s, min(s + per, len(lens)))) for s in range(0, len(lens), per)]


def row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(row(header, widths))
    print(row(["-" * w for w in widths], widths))
    for r in rows:
        print(row(r, widths))
    print()


def bench_micro(args: argparse.Namespace) -> None:
    settings = []
    for dist in ("rl-lognormal", "long-tail", "half-budget"):
        for factor in (2, 3):
            settings.append((dist, factor))
    header = [
        "distribution",
        "n",
        "budget",
        "planner",
        "mean count",
        "mean max/mean",
        "worst max/mean",
        "over budget",
        "worst load",
        "ms/call",
    ]
    rows = []
    for dist, factor in settings:
        budget = factor * MAX_LEN
        # longest sequence the distribution can produce: what a fixed micro-batch size must assume
        max_len = budget // 2 + budget // 16 if dist == "half-budget" else MAX_LEN
        rng = random.Random(f"{dist}-{factor}")
        batches = []
        for _ in range(args.trials):
            if dist == "rl-lognormal":
                batches.append(rl_lengths(rng, args.n))
            elif dist == "long-tail":
                batches.append(long_tail_lengths(rng, args.n))
            else:
                batches.append(half_budget_lengths(rng, args.n, budget))
        planners = {
            "posttrain": lambda lens, b=budget: plan_token_micro_batches(lens, b),
            "naive count": lambda lens, b=budget, m=max_len: naive_split(lens, b, m),
            "verl-style KK": lambda lens, b=budget: verl_rearrange_micro_batches(lens, b),
            "verl-style KK (tokens)": lambda lens, b=budget: verl_rearrange_micro_batches(
                lens, b, use_workload=False
            ),
        }
        for name, plan_fn in planners.items():
            counts, ratios, over, worst = [], [], 0, 0
            start = time.perf_counter()
            plans = [plan_fn(lens) for lens in batches]
            ms = (time.perf_counter() - start) * 1000 / len(batches)
            for lens, plan in zip(batches, plans):
                ld = loads(lens, plan)
                counts.append(len(plan))
                ratios.append(max(ld) / (sum(ld) / len(ld)))
                over += sum(1 for x in ld if x > budget)
                worst = max(worst, max(ld))
            rows.append(
                [
                    dist,
                    str(args.n),
                    str(budget),
                    name,
                    f"{statistics.mean(counts):.2f}",
                    f"{statistics.mean(ratios):.4f}",
                    f"{max(ratios):.4f}",
                    str(over),
                    str(worst),
                    f"{ms:.1f}",
                ]
            )
    print(
        f"## Token-budget micro-batches ({args.trials} random batches per row; lower bound on the count is "
        f"ceil(total/budget))\n"
    )
    print_table(header, rows)


def bench_balance(args: argparse.Namespace) -> None:
    header = ["distribution", "n", "k ranks", "method", "mean max/mean", "worst max/mean", "ms/call"]
    rows = []
    methods = (
        ("posttrain balance_batch", lambda lens, k: balance_batch(lens, k)),
        ("verl-style KK", lambda lens, k: verl_kk_partitions(lens, k, equal_size=True)),
    )
    for n in args.global_batch:
        for dist in ("rl-lognormal", "long-tail"):
            for k in (k for k in (2, 4, 8, 16) if n % k == 0):
                rng = random.Random(f"bal-{dist}-{n}-{k}")
                make = rl_lengths if dist == "rl-lognormal" else long_tail_lengths
                batches = [make(rng, n) for _ in range(args.trials)]
                for name, fn in methods:
                    start = time.perf_counter()
                    parts = [fn(lens, k) for lens in batches]
                    ms = (time.perf_counter() - start) * 1000 / len(batches)
                    ratios = [partition_stats(lens, p)["max_over_mean"] for lens, p in zip(batches, parts)]
                    rows.append(
                        [
                            dist,
                            str(n),
                            str(k),
                            name,
                            f"{statistics.mean(ratios):.6f}",
                            f"{max(ratios):.6f}",
                            f"{ms:.1f}",
                        ]
                    )
    print(f"## DP balancing, equal sequence counts per rank ({args.trials} random global batches per row)\n")
    print_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=128, help="sequences per rank for micro-batch planning")
    parser.add_argument(
        "--global-batch", type=int, nargs="+", default=[256, 32], help="sequences to balance over DP ranks"
    )
    parser.add_argument("--trials", type=int, default=30, help="random batches per setting")
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    print(
        f"settings: n={args.n} global_batch={args.global_batch} trials={args.trials} "
        f"max_prompt={MAX_PROMPT} max_response={MAX_RESPONSE} budgets = 2x and 3x {MAX_LEN} tokens\n"
    )
    bench_micro(args)
    bench_balance(args)


if __name__ == "__main__":
    main()
