"""The command-line flags of `posttrain explain` and `posttrain tune`: the cluster and the what-ifs of the memory
estimate, and tune's trial limits. Apart from the planning modules that use them (which load torch) so that
`posttrain --help` answers without them."""

from __future__ import annotations

import argparse


def add_explain_args(p: argparse.ArgumentParser) -> None:
    add_world_size_arg(p)
    p.add_argument("--json", action="store_true", help="Print the plan as JSON (stable keys)")
    p.add_argument("--keys", action="store_true", help="List every config key with its unit and help")
    p.add_argument(
        "--suggest", action="store_true", help="Also print the seeds' starting point for this model size"
    )
    add_cluster_args(p)


def add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory-cap-gb",
        type=float,
        default=None,
        help="Memory a trial may use, GiB (default: the GPU's memory; on CPU the available RAM)",
    )
    p.add_argument("--headroom", type=float, default=0.1, help="Fraction of the cap kept free (default 0.1)")
    p.add_argument(
        "--time-budget-s", type=float, default=300.0, help="Stop starting trials after this (0: no trials)"
    )
    p.add_argument("--max-trials", type=int, default=12, help="Most trials in total (default 12)")
    p.add_argument(
        "--roles", default=None, help="Comma list of actor,old_log_prob,critic,values (default: used ones)"
    )
    p.add_argument("--max-micro-batch", type=int, default=None, help="Largest micro-batch size to try")
    p.add_argument(
        "--rows", type=int, default=None, help="Samples per measured step (default: mini-batch per rank)"
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="Timed steps per trial; the fastest counts (default 2)"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="Where to measure")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per trial (default 1)")
    p.add_argument(
        "--output", default=None, help="Overlay YAML to write (default <trainer.run_dir>/tuned.yaml)"
    )
    add_world_size_arg(p)
    add_cluster_args(p)


def add_world_size_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="Number of GPUs/processes (default: nodes x gpus-per-node)",
    )


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster and what-if inputs of the memory estimate (docs/tuning.md)")
    g.add_argument("--nodes", type=int, default=1, help="Nodes (default 1)")
    g.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (default 1)")
    g.add_argument(
        "--gpu-memory-gb", type=float, default=None, help="Memory per GPU in GiB (enables OOM warnings)"
    )
    g.add_argument(
        "--model-config", default=None, help="config.json (or its directory) giving the architecture"
    )
    # The sharding what-ifs default to None: the config's <role>.fsdp_config keys, as the trainer applies them.
    g.add_argument(
        "--fsdp-size",
        type=int,
        default=None,
        help="What if every role were sharded over this many GPUs (-1: all; default: <role>.fsdp_config)",
    )
    g.add_argument(
        "--param-offload",
        action="store_true",
        default=None,
        help="What if every role's parameters were offloaded to CPU (default: <role>.fsdp_config)",
    )
    g.add_argument(
        "--optimizer-offload",
        action="store_true",
        default=None,
        help="What if optimizer states were offloaded to CPU (default: <role>.fsdp_config)",
    )
    g.add_argument(
        "--lora-rank", type=int, default=0, help="What if only LoRA adapters of this rank were trained"
    )
    g.add_argument(
        "--master-weights-fp32",
        action="store_true",
        default=None,
        help="What if fp32 master weights (default: as the trainer does, when sharded on several GPUs)",
    )
    g.add_argument(
        "--rollout-engine",
        default=None,
        choices=("native", "vllm"),
        help="Rollout engine to model (default: rollout.name)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's reserved fraction (default: rollout.gpu_memory_utilization)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=None, help="Concurrent sequences (default: rollout.max_num_seqs)"
    )
    g.add_argument(
        "--rollout-tp",
        type=int,
        default=None,
        help="vLLM's TP size (default: rollout.tensor_model_parallel_size)",
    )
