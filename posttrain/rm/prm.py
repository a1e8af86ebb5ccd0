"""The process reward model: a Hugging Face ``*ForTokenClassification`` with two labels (1: the step is
correct), its loss, step scores, validation and export.

From a causal LM checkpoint the classifier head (``score``) is new and the decoder's weights are the LM's; a
token classifier with two labels is loaded as it is. A step's score is softmax(logits)[1] at the last token
of its separator (posttrain.rm.prm_data), the positions that carry a label.

Loss: cross-entropy over the labelled positions of the step's rows, summed per micro-batch and divided by the
labelled positions of the whole step, so micro-batching does not change the gradient (tested).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForTokenClassification

from posttrain.config.errors import ConfigError
from posttrain.models.hf import check_model_dir, save_hf
from posttrain.rm.model import load_with_head, pad_right
from posttrain.rm.prm_data import IGNORED, TokenizedSteps
from posttrain.train.trainable import Trainable
from posttrain.utils.storage import atomic_dir

CORRECT = 1  # the label of a correct step, and the class whose probability is the step's score


def load_prm(path: str | Path, pad_token_id: int, dtype: str = "fp32", device="cpu") -> nn.Module:
    """A two-label token classifier from ``path`` (a causal LM gets a new head)."""
    path = check_model_dir(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    token_cls = any(a.endswith("ForTokenClassification") for a in (config.architectures or []))
    if token_cls and config.num_labels != 2:
        raise ConfigError(
            f"model.path={path} is a token classifier with num_labels={config.num_labels}; a process reward "
            "model has two labels (0: wrong step, 1: correct step): start from a causal LM or a 2-label model"
        )
    model = load_with_head(AutoModelForTokenClassification, path, 2, dtype)
    # as TRL's PRM trainer by default: dropout (the head's 0.1) off, so a step's gradient does not depend on how
    # it is cut in micro-batches
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    model.config.pad_token_id = pad_token_id
    model.config.use_cache = False
    return model.to(device)


def _batch(rows: list[TokenizedSteps], pad_token_id: int, device) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, labels) ``[B, T]``, right-padded; pads carry IGNORED labels."""
    ids, mask = pad_right([r.input_ids for r in rows], pad_token_id)
    labels = torch.full_like(ids, IGNORED)
    for i, r in enumerate(rows):
        labels[i, : len(r.labels)] = torch.tensor(r.labels, dtype=torch.long)
    return ids.to(device), mask.to(device), labels.to(device)


def token_logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, 2]`` float32 logits (right padding: positions count from 0 as in an unpadded forward)."""
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()


def prm_loss(logits: torch.Tensor, labels: torch.Tensor, normalizer: float) -> tuple[torch.Tensor, int, int]:
    """(summed cross-entropy over labelled positions / ``normalizer``, correct predictions, labelled positions)."""
    flat, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    loss = F.cross_entropy(flat, target, ignore_index=IGNORED, reduction="sum") / normalizer
    seen = target != IGNORED
    correct = int((flat.argmax(-1)[seen] == target[seen]).sum())
    return loss, correct, int(seen.sum())


def prm_step(
    trainable: Trainable, rows: list[TokenizedSteps], pad_token_id: int, micro: int
) -> dict[str, float]:
    """One optimizer step on ``rows``, in micro-batches of ``micro`` rows; one normalisation by the labelled
    steps of all of them."""
    model, opt = trainable.module, trainable.optimizer
    device = next(model.parameters()).device
    total = sum(sum(1 for x in r.labels if x != IGNORED) for r in rows)
    model.train()
    opt.zero_grad(set_to_none=True)
    loss_sum, correct = 0.0, 0
    for lo in range(0, len(rows), micro):
        ids, mask, labels = _batch(rows[lo : lo + micro], pad_token_id, device)
        loss, right, _ = prm_loss(token_logits(model, ids, mask), labels, total)
        loss.backward()
        loss_sum, correct = loss_sum + float(loss.detach()), correct + right
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), trainable.grad_clip or float("inf")))
    metrics = {"prm/loss": loss_sum, "prm/step_accuracy": correct / total, "prm/grad_norm": grad_norm}
    metrics["prm/lr"] = trainable.lr
    if torch.isfinite(torch.tensor(grad_norm)):
        opt.step()
    else:  # a non-finite gradient would poison the weights: skipped and counted (the loop's guard reads it)
        metrics["prm/skipped_steps"] = 1.0
    trainable.scheduler.step()
    return metrics


@torch.no_grad()
def validate_steps(
    model: nn.Module, rows: list[TokenizedSteps], pad_token_id: int, batch: int
) -> dict[str, float]:
    """Held-out step accuracy (argmax at each labelled position), mean loss per step, and the accuracy of
    whole chains (every step right)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    loss_sum, correct, steps, chains_right = 0.0, 0, 0, 0
    for lo in range(0, len(rows), batch):
        ids, mask, labels = _batch(rows[lo : lo + batch], pad_token_id, device)
        logits = token_logits(model, ids, mask)
        loss, right, seen = prm_loss(logits, labels, 1.0)
        loss_sum, correct, steps = loss_sum + float(loss), correct + right, steps + seen
        wrong = (logits.argmax(-1) != labels) & (labels != IGNORED)
        chains_right += int((~wrong.any(-1)).sum())
    model.train(was_training)
    return {
        "val/step_accuracy": correct / steps,
        "val/loss": loss_sum / steps,
        "val/chain_accuracy": chains_right / len(rows),
    }


@torch.no_grad()
def step_scores(model: nn.Module, row: TokenizedSteps) -> list[float]:
    """The score of each step of one row: softmax(logits)[CORRECT] at its labelled position."""
    device = next(model.parameters()).device
    ids = torch.tensor([row.input_ids], device=device)
    probs = token_logits(model, ids, torch.ones_like(ids)).softmax(-1)[0, :, CORRECT]
    return [float(probs[i]) for i, label in enumerate(row.labels) if label != IGNORED]


def export_prm(
    model: nn.Module, tokenizer, path: str | Path, separator: str, stats: dict[str, float]
) -> Path:
    """Save a plain ``AutoModelForTokenClassification`` directory with ``step_separator`` (and the held-out
    ``stats``) in its config, written atomically."""
    path = Path(path)
    model.config.step_separator = separator
    model.config.id2label, model.config.label2id = {0: "wrong", 1: "correct"}, {"wrong": 0, "correct": 1}
    for key, value in stats.items():
        setattr(model.config, key.replace("/", "_"), float(value))
    model.config.architectures = [type(model).__name__]
    with atomic_dir(path, "the process reward model") as tmp:  # a kill mid-write leaves no half export
        save_hf(model, tokenizer, tmp)
    return path
