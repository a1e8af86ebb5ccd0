"""Write demonstration conversations of a built-in agentic task as a jsonl that `posttrain sft` reads.

    python examples/agents/make_demos.py calculator demos.jsonl --n 2000
    posttrain sft model.path=builtin:base sft.train_files=[demos.jsonl] data.prompt_key=messages \
        sft.response_key='' ...

The demonstrations are drawn over the task's training split (the same seed and sizes as the run), so the held-out
problems stay unseen. See docs/agents.md, "Built-in tasks".
"""

import argparse

from posttrain.agents.demos import DEMONSTRATIONS, demonstrations, write_jsonl
from posttrain.data.tasks import load_task


def task_option(text: str) -> tuple[str, int | str]:
    """``NAME=VALUE`` (a whole-number value becomes an int, as the config's data.task_options.NAME=VALUE does)."""
    name, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--option {text!r}: write NAME=VALUE, e.g. --option high=31")
    return name, int(value) if value.lstrip("-").isdigit() else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(DEMONSTRATIONS))
    parser.add_argument("out", help="the jsonl file to write")
    parser.add_argument("--n", type=int, default=2000, help="demonstrations to write")
    parser.add_argument("--seed", type=int, default=0, help="trainer.seed of the run (it draws the splits)")
    parser.add_argument("--n-train", type=int, default=480, help="data.num_train_examples of the run")
    parser.add_argument("--n-val", type=int, default=128, help="data.num_val_examples of the run")
    parser.add_argument("--rate", type=float, default=None, help="imperfection: calculator's and python_arithmetic's "
                        "share without the tool, guess_number's share of random guesses (default: the task's)")  # fmt: skip
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="data.task_options of the run, e.g. --option high=31 --option max_turns=5")  # fmt: skip
    args = parser.parse_args()
    options = dict(task_option(text) for text in args.option)
    train, _ = load_task(args.task, args.seed, n_train=args.n_train, n_val=args.n_val, **options)
    rows = demonstrations(args.task, train, args.n, args.seed, args.rate)
    path = write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} {args.task} demonstrations to {path}")


if __name__ == "__main__":
    main()
