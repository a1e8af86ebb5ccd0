"""Where a default GRPO step's time goes: torch's profiler over one step, grouped by kind of work.

Run::

    python3 benchmarks/profile_grpo_step.py --shape 8x8x128
    ATEN_CPU_CAPABILITY=avx2 python3 benchmarks/profile_grpo_step.py --shape 8x8x32

The step is the one ``benchmarks/grpo_step_vs_trl.py`` times (the same config: tiny Qwen2 with random weights,
fp32, one thread, one optimizer step per rollout, posttrain's defaults plus ``--set`` overrides), after one
untimed warm-up step. Printed: the step's phases, the self time of torch's operators (the profiler's clock is wall time: run it on an idle
machine) grouped into matrix
products, attention, element-wise and reductions, data movement (index/gather/scatter/copy/cat), and the rest
of the step (Python, the scheduler, tokenization, batch assembly: wall time not spent inside an operator); then
the operators that took most time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_step_vs_trl import parse_shape, posttrain_config  # noqa: E402

from posttrain.models.tiny import create_tiny_model_dir  # noqa: E402
from posttrain.parallel.runtime import select_device  # noqa: E402
from posttrain.rl.build import build_components  # noqa: E402
from posttrain.rl.step import train_step  # noqa: E402
from posttrain.utils.allocator import keep_freed_memory_for_cpu_training  # noqa: E402
from posttrain.utils.console import print_table  # noqa: E402
from posttrain.utils.metrics import PhaseTimer  # noqa: E402
from posttrain.utils.seed import seed_everything  # noqa: E402

KINDS = {
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul"),
    "attention": ("aten::_scaled_dot_product",),
    "data movement": (
        "aten::index",
        "aten::_index",
        "aten::gather",
        "aten::scatter",
        "aten::copy_",
        "aten::cat",
    ),
}


def kind_of(name: str) -> str:
    for kind, prefixes in KINDS.items():
        if name.startswith(prefixes):
            return kind
    return "element-wise and reductions"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=parse_shape, default=(8, 8, 128), help="PROMPTSxNxTOKENS")
    parser.add_argument(
        "--set", nargs="*", default=[], help="config overrides, e.g. actor.use_prefix_grouper=false"
    )
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    args.prompts, args.n, args.max_tokens = args.shape
    args.optimizer_steps, args.lr, args.steps = 1, 1e-5, 1
    torch.set_num_threads(1)
    print("command: python3 " + " ".join(sys.argv))
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread; "
        f"load average {os.getloadavg()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_model_dir(Path(tmp) / "tiny", seed=0)
        cfg = posttrain_config(args, model_dir, Path(tmp) / "run", args.set)
        keep_freed_memory_for_cpu_training(
            cfg.trainer.tune_malloc, select_device(cfg)
        )  # as `posttrain train`
        seed_everything(0)
        run = build_components(cfg, quiet=True)
        timer = PhaseTimer()
        try:
            train_step(run, 1, timer)  # warm-up
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                metrics = train_step(run, 2, timer)
                step_cpu = time.perf_counter() - start
        finally:
            run.close()
    phases = {k.removeprefix("timing/"): round(v, 3) for k, v in metrics.items() if k.startswith("timing/")}
    print(f"step: {step_cpu:.3f} wall s (under the profiler); phases (wall s): {phases}")
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + e.self_cpu_time_total / 1e6
    in_ops = sum(by_kind.values())
    by_kind["rest of the step (Python, scheduler, batch assembly)"] = max(step_cpu - in_ops, 0.0)
    print_table(
        f"shape {args.prompts}x{args.n}x{args.max_tokens}: self time by kind",
        [{"kind": k, "s": round(v, 3), "share": f"{100 * v / step_cpu:.1f}%"} for k, v in by_kind.items()],
    )
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    print_table(
        "operators with the most self time",
        [
            {
                "operator": e.key,
                "calls": e.count,
                "self s": round(e.self_cpu_time_total / 1e6, 3),
                "share": f"{100 * e.self_cpu_time_total / 1e6 / step_cpu:.1f}%",
            }
            for e in top
        ],
    )


if __name__ == "__main__":
    main()
