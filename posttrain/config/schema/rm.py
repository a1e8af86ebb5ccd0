"""The `rm` section: Bradley-Terry reward-model training (`posttrain rm`).

The shared keys work as for `posttrain sft`: model.path (a causal LM, which gets a scalar head, or a
sequence-classification model with one label), data.train_files / data.val_files (preference pairs),
trainer.run_dir, trainer.seed, trainer.save_freq, trainer.resume, trainer.test_freq.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import knob, section
from posttrain.config.schema.roles import OptimConfig


@dataclass
class RMConfig:
    """Reward-model training on preference pairs (`posttrain rm`)."""

    kind: str = knob(
        "pairs",
        "What is trained: 'pairs', a Bradley-Terry reward model on preference pairs (one score per text); "
        "'prm', a process reward model on stepwise rows {prompt, completions: [step, ...], labels: [bool, ...]} "
        "(TRL's format; a token classifier with two labels scoring each step).",
        choices=("pairs", "prm"),
    )
    step_separator: str = knob(
        "\n",
        "rm.kind=prm: the text appended after every step (its tokens, encoded alone, follow each step's); a "
        "step is scored at the separator's last token. Stored in the exported model's config.",
    )
    prompt_key: str = knob(
        "prompt",
        "Field holding the prompt (a string or chat messages). A row without it is an implicit-prompt pair: "
        "chosen and rejected are whole conversations (or whole texts).",
    )
    chosen_key: str = knob("chosen", "Field holding the preferred response (a string or chat messages).")
    rejected_key: str = knob("rejected", "Field holding the other response (a string or chat messages).")
    margin_key: str = knob(
        "",
        "Field holding a per-pair margin m (a number): the loss is -log sigmoid(r_chosen - r_rejected - m). "
        "Empty: no margin.",
    )
    max_length: int = knob(
        512,
        "Longest text (prompt + response) in tokens; a pair with a longer side is dropped and counted.",
        unit="tokens",
        min=2,
    )
    batch_size: int = knob(32, "Pairs per optimizer step (global).", unit="pairs", min=1)
    micro_batch_size_per_gpu: int = knob(
        8, "Pairs per forward/backward pass on one DP rank.", unit="pairs per DP rank", min=1
    )
    use_dynamic_bsz: bool = knob(
        False,
        "Form training micro-batches by token budget (rm.max_token_len_per_gpu) instead of "
        "rm.micro_batch_size_per_gpu: whole pairs, as few micro-batches as fit. The gradient is the same.",
    )
    max_token_len_per_gpu: int = knob(
        16384,
        "Token budget of one training micro-batch when rm.use_dynamic_bsz is on: real tokens of its pairs, "
        "chosen and rejected; a pair longer than it is refused before training.",
        unit="tokens per GPU",
        min=2,
    )
    epochs: int = knob(1, "Passes over the training pairs.", unit="epochs", min=1)
    max_steps: int = knob(
        0, "Stop after this many optimizer steps (0: run all epochs).", unit="optimizer steps", min=0
    )
    center_rewards_coefficient: float = knob(
        0.0,
        "Weight of the centering term mean((r_chosen + r_rejected)^2), which keeps rewards near 0 "
        "(0: off; 0.01 is the usual value).",
        min=0.0,
    )
    output_dir: str = knob(
        "", "Where `posttrain rm` exports the reward model; empty: <trainer.run_dir>/reward_model."
    )
    optim: OptimConfig = section(OptimConfig, lr=1e-4)
