"""Model-state and step memory of the actor with LoRA on and off: measured tensors, measured RSS, and the estimator.

Run: ``python benchmarks/bench_lora_memory.py`` (about three minutes on 2 CPU cores: one child process per row for
the step measurement).

Setting: the Qwen2 of tests/planning/test_estimator_vs_measured.py (hidden 512, 4 layers, 8 heads / 4 KV heads,
intermediate 1408, 4,096-token tied vocabulary; random fp32 weights, sdpa), one actor micro-batch of 8 samples of
128 + 128 tokens, the trainer's own actor loss with a KL term (so a reference policy exists).

Columns:

* ``params (trainable)``, ``optimizer states``, ``gradients``: bytes of the tensors themselves, measured in this
  process after one real training step (``accumulate_and_step``): all parameters (those with ``requires_grad``),
  the AdamW moments in ``optimizer.state``, and every ``.grad`` after one more backward.
* ``reference copy``: bytes of the parameters of the reference policy the trainer builds (``setup.build_components``
  builds a ``deepcopy`` without LoRA, the actor with adapters disabled with LoRA: no parameters of its own).
* ``step (RSS)``: the working memory of one actor micro-batch, high-water RSS minus the post-setup RSS, in a fresh
  child (``posttrain.planning.measure``), as tests/planning/test_estimator_vs_measured.py measures it.
* ``estimated``: ``posttrain.planning.memory.estimate_memory`` for the same config (actor weights + optimizer +
  reference weights; and the update phase's gradients/activations + head).
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from posttrain.algorithms.aggregation import LossNormalizer  # noqa: E402
from posttrain.batching.micro import micro_batch_rows
from posttrain.config.load import build_config  # noqa: E402
from posttrain.config.plan import build_plan  # noqa: E402
from posttrain.models.lora import apply_lora, is_lora_model, reference_policy  # noqa: E402
from posttrain.planning.measure import TrialSpec, run_trial_in_subprocess, synthetic_batch  # noqa: E402
from posttrain.planning.memory import estimate_memory  # noqa: E402
from posttrain.planning.shape import ModelShape  # noqa: E402
from posttrain.train.losses import actor_loss_fn
from posttrain.train.trainable import Trainable
from posttrain.train.update import accumulate_and_step

MODEL = Qwen2Config(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=True,
)
PROMPT = RESPONSE = 128
MICRO = 8
BASE = [
    f"data.max_prompt_length={PROMPT}",
    f"data.max_response_length={RESPONSE}",
    "actor.use_kl_loss=true",
    f"actor.ppo_micro_batch_size_per_gpu={MICRO}",
    f"actor.log_prob_micro_batch_size_per_gpu={MICRO}",
]
ROWS = {"full fine-tuning": [], "LoRA r=8": ["model.lora_rank=8"], "LoRA r=32": ["model.lora_rank=32"]}
MIB = 2**20


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def measure_states(overrides: list[str]) -> dict[str, int]:
    cfg = build_config(overrides=[*BASE, *overrides])
    torch.manual_seed(0)
    policy = apply_lora(AutoModelForCausalLM.from_config(MODEL, attn_implementation="sdpa"), cfg)
    ref = reference_policy(policy) if is_lora_model(policy) else copy.deepcopy(policy).requires_grad_(False)
    trainable = Trainable.create(policy, cfg.actor.optim, 10)
    batch = synthetic_batch(MICRO, PROMPT, RESPONSE, MODEL.vocab_size)
    normalizer = LossNormalizer.from_mask(batch.response_mask, float(RESPONSE))
    policy.train()
    accumulate_and_step(
        policy,
        trainable.optimizer,
        None,
        batch,
        micro_batch_rows(batch, MICRO, None),
        actor_loss_fn(policy, cfg.actor, 1.0),
        normalizer,
        0.0,
    )
    states = [t for s in trainable.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    loss, _ = actor_loss_fn(policy, cfg.actor, 1.0)(
        batch, normalizer
    )  # the step zeroed them: one more backward
    loss.backward()
    params = list(policy.parameters())
    return {
        "params": tensor_bytes(params),
        "trainable": tensor_bytes(p for p in params if p.requires_grad),
        "optimizer": tensor_bytes(
            t for t in states if t.dim() > 0
        ),  # exp_avg, exp_avg_sq (not the step counts)
        "gradients": tensor_bytes(p.grad for p in params),
        "reference": tensor_bytes(ref.parameters()),
    }


def estimated(overrides: list[str]) -> dict[str, int]:
    cfg = build_config(overrides=[*BASE, *overrides])
    phase = estimate_memory(cfg, build_plan(cfg), ModelShape.from_hf_config(MODEL)).phase("actor_update")
    return {
        "weights": phase.part("actor weights"),
        "optimizer": phase.part("actor optimizer"),
        "reference": phase.part("reference weights"),
        "step": phase.part("gradients/activations") + phase.part("log-prob/entropy head"),
        "gradients": int(phase.detail["gradients_gib"] * 2**30),
    }


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(__doc__.split("\n\n")[2])
    header = (
        "| setting | params (trainable) | optimizer states | gradients | reference copy | step (RSS) |"
        " estimated: weights / optimizer / reference / step |"
    )
    print(header + "\n|" + "---|" * 7)
    for name, overrides in ROWS.items():
        m, e = measure_states(overrides), estimated(overrides)
        spec = TrialSpec(
            role="actor",
            model_config=MODEL.to_dict(),
            overrides=tuple([*BASE, *overrides]),
            prompt_len=PROMPT,
            response_len=RESPONSE,
            rows=MICRO,
            micro_batch_size=MICRO,
            repeats=1,
        )
        step = run_trial_in_subprocess(spec)
        step_text = f"{step.step_bytes / MIB:.0f} MiB" if step.status == "ok" else step.status
        print(
            f"| {name} | {m['params'] / MIB:.1f} MiB ({m['trainable'] / MIB:.1f} MiB) | {m['optimizer'] / MIB:.1f} MiB | "
            f"{m['gradients'] / MIB:.1f} MiB | {m['reference'] / MIB:.1f} MiB | {step_text} | "
            f"{e['weights'] / MIB:.1f} / {e['optimizer'] / MIB:.1f} / {e['reference'] / MIB:.1f} / "
            f"{e['step'] / MIB:.0f} MiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
