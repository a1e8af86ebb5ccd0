"""TRL's side of ``grpo_step_vs_trl.py``: one ``GRPOTrainer`` round with the settings that script's docstring
lists (TRL is never a runtime dependency of posttrain: ``pip install "posttrain[bench]"``)."""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch

from posttrain.data.records import PromptRecord
from posttrain.data.tasks.arithmetic import arithmetic_reward


def run_trl(
    args: argparse.Namespace, records: list[PromptRecord], model_dir: Path, seed: int
) -> list[tuple[float, float]]:
    """Warm-up step + ``args.steps`` timed steps (``optimizer_steps`` TRL steps each) on ``records`` (the
    arithmetic task's training problems); returns (wall, CPU) seconds per step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": r.prompt}] for r in records],
            "ground_truth": [r.ground_truth for r in records],
        }
    )

    def reward(prompts, completions, ground_truth, **kwargs):
        return [arithmetic_reward("", c[0]["content"], gt, {}) for c, gt in zip(completions, ground_truth)]

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.begins: list[float] = []
            self.ends: list[float] = []

        def on_step_begin(self, *a, **k):
            self.begins.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, *a, **k):
            self.ends.append((time.perf_counter(), time.process_time()))

    k = args.optimizer_steps
    samples = args.prompts * args.n
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            num_generations=args.n,
            per_device_train_batch_size=samples // k,
            gradient_accumulation_steps=1,
            steps_per_generation=k,
            num_iterations=1,
            max_completion_length=args.max_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            epsilon=0.2,
            loss_type="dapo",
            scale_rewards="group",
            max_steps=k * (args.steps + 1),
            logging_steps=10_000,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=seed,
            dataloader_num_workers=0,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        timer = StepTimes()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    # posttrain step s = TRL steps [k*s, k*s + k): from the first one's begin to the last one's end.
    times = []
    for s in range(1, args.steps + 1):
        begin, end = timer.begins[k * s], timer.ends[k * s + k - 1]
        times.append((end[0] - begin[0], end[1] - begin[1]))
    return times
