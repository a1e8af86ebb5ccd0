"""The `posttrain` command line: train, sft, eval, explain.

Every subcommand takes optional YAML files and dotted overrides, in any order:
    posttrain train my.yaml actor.ppo_mini_batch_size=16 trainer.total_steps=20
A configuration error prints one message and exits with code 2, before any heavy work.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from posttrain import __version__

EXIT_CONFIG_ERROR = 2


def _split_args(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional words are YAML files unless they contain '=' (then they are overrides)."""
    yamls = [i for i in items if "=" not in i]
    overrides = [i for i in items if "=" in i]
    return yamls, overrides


def _load(args: argparse.Namespace):
    from posttrain.config.load import build_config

    yamls, overrides = _split_args(args.config)
    return build_config(yamls, overrides)


def cmd_explain(args: argparse.Namespace) -> int:
    from rich.console import Console

    from posttrain.config.explain import plan_tree
    from posttrain.config.load import all_keys, field_info
    from posttrain.config.plan import build_plan

    if args.keys:
        for key in all_keys():
            field, _ = field_info(key)
            unit = f" [{field.metadata['unit']}]" if field.metadata.get("unit") else ""
            print(f"{key}{unit}: {field.metadata.get('help', '')}")
        return 0
    cfg = _load(args)
    plan = build_plan(cfg, world_size=args.world_size)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        # Piped output (CI logs, files) gets a fixed width instead of rich's 80-column default.
        console = Console()
        if not console.is_terminal:
            console = Console(width=120)
        console.print(plan_tree(cfg, plan))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from posttrain.trainers.rl import run_training

    run_training(_load(args))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from posttrain.trainers.sft import run_sft_command

    run_sft_command(_load(args))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from posttrain.trainers.evaluate import run_eval_command

    run_eval_command(_load(args), model_path=args.model)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain", description="RL post-training of LLMs (PPO, GRPO and relatives)."
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("config", nargs="*", help="YAML override files and key=value overrides")
        p.set_defaults(fn=fn)
        return p

    add("train", cmd_train, "Run RL training (default: GRPO on the built-in arithmetic task, CPU-sized).")
    add("sft", cmd_sft, "Supervised fine-tuning on prompt/response data.")
    p = add("eval", cmd_eval, "Validation accuracy of a model directory or checkpoint on the task.")
    p.add_argument("--model", default=None, help="Model directory or checkpoint (default: model.path)")
    p = add("explain", cmd_explain, "Print the batch plan derived from a config.")
    p.add_argument("--world-size", type=int, default=1, help="Number of GPUs/processes (default 1)")
    p.add_argument("--json", action="store_true", help="Print the plan as JSON (stable keys)")
    p.add_argument("--keys", action="store_true", help="List every config key with its unit and help")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as exc:
        # User errors (config, data, paths): one clear message, no traceback.
        print(f"posttrain {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        print(f"posttrain {args.command}: interrupted; the last complete checkpoint is intact", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
