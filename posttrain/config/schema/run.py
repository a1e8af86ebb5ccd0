"""The run (trainer), rollouts ahead of training, and supervised fine-tuning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.config.fields import knob, section
from posttrain.config.schema.roles import OptimConfig


@dataclass
class CollapseConfig:
    """When a run warns that it may be collapsing: one line per sign, once per run; a warning changes nothing in
    the run (docs/reliability.md, "A collapsing run")."""

    truncated_jump: float = knob(
        0.3,
        "Warn when the truncated share (truncated/share, else finish/length) rose this much above its lowest of "
        "the run so far and is at least truncated_min.",
        min=0.0,
        max=1.0,
    )
    truncated_min: float = knob(
        0.5, "The truncated share the jump must reach (see truncated_jump).", min=0.0, max=1.0
    )
    entropy_fraction: float = knob(
        0.2,
        "Warn when actor/entropy falls below this fraction of its first step's value; 0 never warns.",
        min=0.0,
        max=1.0,
    )
    zero_reward_steps: int = knob(
        3,
        "Warn when the trained batch's reward/mean is exactly 0 this many steps in a row.",
        unit="steps",
        min=1,
    )
    tool_rate_rise: float = knob(
        0.2,
        "Warn when tools/call_frequency rose this much above its first step's value while success "
        "(reward/accuracy, else reward/mean) fell success_drop below its first step's.",
        min=0.0,
    )
    success_drop: float = knob(
        0.02, "How far success must fall for the tools sign (see tool_rate_rise).", min=0.0
    )


@dataclass
class TrainerConfig:
    """The run: length, validation, checkpoints, logging, device."""

    total_steps: int = knob(40, "Training steps (one rollout + update each).", unit="steps", min=1)
    test_freq: int = knob(5, "Validate every this many steps (and before training); 0 disables.", min=0)
    save_freq: int = knob(0, "Checkpoint every this many steps (and at the end); 0: only at the end.", min=0)
    max_ckpt_to_keep: int = knob(2, "Complete checkpoints kept; older ones are deleted.", min=1)
    run_dir: str = knob("runs/latest", "Directory for metrics, the resolved config, plots and checkpoints.")
    resume: str = knob("auto", "'auto' (latest checkpoint in run_dir), 'disable', or a checkpoint path.")
    seed: int = knob(1, "Seed for data order, sampling and the built-in model.")
    device: str = knob(
        "auto", "'auto' (CUDA when present), 'cpu' or 'cuda'.", choices=("auto", "cpu", "cuda")
    )
    tune_malloc: bool = knob(
        True,
        "Training on the CPU under Linux/glibc: keep freed memory in the process for the next step (mallopt: "
        "no mmap for large blocks, no heap trimming) instead of returning it to the OS and faulting it in "
        "again; the process keeps its peak memory until it exits. Never changes results (docs/performance.md).",
    )
    loggers: list[str] = knob(
        default_factory=lambda: ["console", "jsonl"], help="Metric sinks: console, jsonl, tensorboard, wandb."
    )
    export_hf: bool = knob(True, "Export the final policy as a Hugging Face model directory.")
    dist_timeout_s: float = knob(
        600.0,
        "With several ranks: seconds a collective may wait for the other ranks before the job fails with "
        "an error (a dead or hung rank ends the run instead of hanging it).",
        unit="seconds",
        min=1.0,
    )
    max_skipped_steps: int = knob(
        3,
        "Stop with an error after this many consecutive training steps whose optimizer steps were all "
        "skipped for a non-finite loss or gradient.",
        unit="steps",
        min=1,
    )
    save_on_terminate: bool = knob(
        False, "On SIGTERM, finish the current step and save a checkpoint before exiting (code 143)."
    )
    export_merged: bool = knob(
        False,
        "With LoRA: export the policy with its adapters merged into the base weights, a plain Hugging Face "
        "model (AutoModelForCausalLM), instead of the PEFT adapter directory (PeftModel.from_pretrained). "
        "Applies to `posttrain train` and `posttrain sft`.",
    )
    ray_ranks: int = knob(
        0,
        "N > 0: `posttrain train` asks Ray for N trainer processes (one placement-group bundle each, on this "
        "node or others) and runs the job on them with torch.distributed, as torchrun would; pip install "
        "'posttrain[ray]'. 0: the launched process (or torchrun's ranks) trains.",
        unit="ranks",
        min=0,
    )
    ray_cpus_per_rank: int = knob(
        1,
        "With ray_ranks: CPUs Ray reserves for each trainer rank (its torch threads: OMP_NUM_THREADS).",
        unit="CPUs",
        min=1,
    )
    ray_gpus_per_rank: int = knob(
        0,
        "With ray_ranks: GPUs Ray reserves for each trainer rank; 1 trains on CUDA, one GPU per rank "
        "(NCCL); 0 trains on CPU (gloo).",
        unit="GPUs",
        min=0,
        max=1,
    )
    ray_resources_per_rank: dict[str, Any] = knob(
        default_factory=dict,
        help="With ray_ranks: custom Ray resources each trainer rank reserves besides its CPUs and GPUs, "
        "to place the ranks on the nodes that offer them (trainer.ray_resources_per_rank.NAME=AMOUNT; a node "
        "offers NAME with `ray start --resources`).",
    )
    ray_placement: str = knob(
        "PACK",
        "With ray_ranks: Ray's placement-group strategy for the ranks' bundles: PACK (as few nodes as "
        "possible), SPREAD (as many as possible), STRICT_PACK (one node), STRICT_SPREAD (one node each).",
        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    )
    ray_max_restarts: int = knob(
        0,
        "With ray_ranks: when a rank dies or fails, start all ranks again up to this many times; they resume "
        "from the last checkpoint in run_dir (as resume=auto does). 0: the run stops, its checkpoint intact.",
        unit="restarts",
        min=0,
    )
    ray_address: str = knob(
        "",
        "The Ray cluster that places the trainer ranks (ray_ranks) and the rollout worker "
        "(async_training.rollout_worker=ray): 'auto' or 'ray://host:port' joins a running cluster; empty "
        "starts a Ray instance on this machine (or uses the one this process already joined).",
    )
    collapse: CollapseConfig = section(CollapseConfig)


@dataclass
class AsyncTrainingConfig:
    """Rollouts generated ahead of training, overlapping the updates (one-step-off-policy and beyond)."""

    enable: bool = knob(
        False,
        "Generate each step's samples while earlier steps train (on a background thread, or a process of its "
        "own: rollout_worker), with a policy at most max_staleness updates old (the engine keeps its own copy "
        "of the weights). Off: rollout and training alternate (fully synchronous).",
    )
    max_staleness: int = knob(
        1,
        "How many updates the sampling policy may lag the one that trains on its samples; rollouts run this "
        "many steps ahead. 1 is verl's one-step-off-policy schedule; 0 runs the synchronous schedule through "
        "the same machinery. Correct the lag with algorithm.rollout_correction.",
        unit="steps",
        min=0,
    )
    rollout_worker: str = knob(
        "thread",
        "Where the rollouts ahead run: 'thread' (a background thread of the trainer's process, on its devices) "
        "or 'ray' (a process of its own that Ray places on rollout_num_cpus / rollout_num_gpus, on this node or "
        "another; pip install 'posttrain[ray]'). Weights travel to it after every update.",
        choices=("thread", "ray"),
    )
    rollout_num_cpus: int = knob(
        1,
        "With rollout_worker=ray: CPUs Ray reserves for the rollout worker (its torch threads).",
        unit="CPUs",
        min=1,
    )
    rollout_num_gpus: int = knob(
        0,
        "With rollout_worker=ray: GPUs Ray reserves for the rollout worker (0: it generates on CPU).",
        unit="GPUs",
        min=0,
    )
    rollout_resources: dict[str, Any] = knob(
        default_factory=dict,
        help="With rollout_worker=ray: custom Ray resources the rollout worker reserves besides its CPUs and "
        "GPUs, to place it on the node that offers them (async_training.rollout_resources.NAME=AMOUNT; a node "
        "offers NAME with `ray start --resources`).",
    )
    partial_rollout: bool = knob(
        False,
        "Start each step's rollout ahead (as enable does) but generate only partial_rollout_tokens tokens per "
        "response there; the responses not finished by then are continued just before the step trains, with "
        "the newest weights (loaded after the last update). Each token keeps the log-prob of the policy that "
        "sampled it. Needs enable=true; not with algorithm.filter_groups.",
    )
    partial_rollout_tokens: int = knob(
        0,
        "With partial_rollout: tokens per response generated ahead, the rest after the reload. 0: half of "
        "data.max_response_length (at least 1); >= data.max_response_length: nothing is left to continue "
        "(the same samples as partial_rollout=false).",
        unit="tokens",
        min=0,
    )


@dataclass
class SFTConfig:
    """Supervised fine-tuning (`posttrain sft`, and the built-in model's warm start)."""

    train_files: list[str] = knob(
        default_factory=list,
        help="Prompt/response files (.parquet, .jsonl, .json, saved `datasets` dir). Empty: the task's "
        "training split, with the ground truth as the response.",
    )
    response_key: str = knob("response", "Field holding the target response.")
    val_files: list[str] = knob(
        default_factory=list,
        help="Held-out prompt/response files: validation loss (and, with a reward, accuracy) every "
        "trainer.test_freq steps and at the end. Empty: data.val_files when they hold sft.response_key.",
    )
    batch_size: int = knob(32, "Examples per optimizer step (global).", unit="examples", min=1)
    micro_batch_size_per_gpu: int = knob(
        32, "Examples per forward/backward pass on one DP rank.", unit="examples per DP rank", min=1
    )
    epochs: int = knob(
        10,
        "Passes over the training examples. The defaults (10 epochs, lr 1e-3, batches of 32) suit the built-in "
        "tiny models (docs/your-task.md); models of 0.5B+ want 1-3 epochs at lr 1e-5 to 2e-5.",
        unit="epochs",
        min=1,
    )
    max_steps: int = knob(
        0, "Stop after this many optimizer steps (0: run all epochs).", unit="optimizer steps", min=0
    )
    output_dir: str = knob("", "Where `posttrain sft` saves the model; empty: <trainer.run_dir>/sft_model.")
    optim: OptimConfig = section(OptimConfig, lr=1e-3)
