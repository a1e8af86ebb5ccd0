"""Gradient accumulation over micro-batches equals one step on the whole mini-batch.

This checks the loss-normalisation contract of posttrain.algorithms.aggregation exactly (float64) on a toy model;
tests/rl/test_throughput_equivalence.py checks the trainer's own accumulation loop
(posttrain.train.update.accumulate_and_step) on a real model.

A tiny prefix-mixing LM with a value head (float64) is trained on a mini-batch whose rows have different lengths
(right/left padding, a single-token row, a fully masked row, a gap). For every aggregation mode and every loss
(vanilla PPO, GSPO, value loss, and PPO + KL loss + entropy bonus together) the accumulated gradient with
micro-batch sizes 1, 2, 3 and the full mini-batch must be identical. The per-micro-batch mean that peers use is
shown to differ, so the test can fail.
"""

from collections.abc import Callable, Mapping, Sequence

import pytest
import torch
from torch import nn

from posttrain.algorithms.aggregation import LossNormalizer, aggregate_loss
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from posttrain.algorithms.names import LOSS_AGG_MODES
from posttrain.algorithms.policy_loss import POLICY_LOSSES, PolicyLossInputs
from posttrain.algorithms.value_loss import compute_value_loss

pytestmark = pytest.mark.numerics  # runs again under other CPU instruction sets in CI

MicroBatch = dict[str, torch.Tensor]
LossFn = Callable[[MicroBatch, LossNormalizer], tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]]


def split_micro_batches(batch: Mapping[str, torch.Tensor], micro_batch_size: int) -> list[MicroBatch]:
    """Cut a batch of row-aligned tensors into consecutive row slices of ``micro_batch_size`` rows.

    Args:
        batch: tensors that all share the leading (row) dimension ``B``.
        micro_batch_size: rows per micro-batch, >= 1; the last micro-batch holds the remainder.

    Returns:
        ``ceil(B / micro_batch_size)`` dicts with the same keys; the slices are views, not copies.
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
    if not batch:
        raise ValueError("batch is empty; nothing to split")
    rows = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise ValueError(
                f"batch[{key!r}] must be a tensor with a row dimension, got {type(value).__name__}"
            )
        rows[key] = value.shape[0]
    if len(set(rows.values())) != 1:
        raise ValueError(f"all tensors in batch must have the same number of rows, got {rows}")
    num_rows = next(iter(rows.values()))
    return [
        {key: value[start : start + micro_batch_size] for key, value in batch.items()}
        for start in range(0, num_rows, micro_batch_size)
    ]


def backward_micro_batches(
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    normalizer: LossNormalizer,
    mask_key: str = "response_mask",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run forward + backward on each micro-batch, accumulating gradients for one optimizer step.

    Args:
        micro_batches: the mini-batch split in any way (e.g. by :func:`split_micro_batches`).
        loss_fn: ``(micro_batch, normalizer) -> (loss, metrics)``; ``loss`` must already be this micro-batch's
            contribution (built with ``aggregate_loss(..., normalizer)``). Its gradient is accumulated as is.
        normalizer: computed once over the whole mini-batch.
        mask_key: key of the ``[b, T]`` response mask in each micro-batch, used to weight metrics.

    Returns:
        ``(loss, metrics)``: the detached sum of the contributions (the mini-batch loss) and each metric averaged
        over micro-batches weighted by their valid-token counts, which turns per-micro-batch masked means (such
        as ``pg_clipfrac``) into exact mini-batch means. The caller steps the optimizer and zeroes gradients.
    """
    if not micro_batches:
        raise ValueError("micro_batches is empty; nothing to backpropagate")
    total: torch.Tensor | None = None
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for micro in micro_batches:
        if mask_key not in micro:
            raise ValueError(f"micro-batch has no {mask_key!r}; keys: {sorted(micro)}")
        loss, metrics = loss_fn(micro, normalizer)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
        num_tokens = float(micro[mask_key].to(torch.float64).sum().item())
        for name, value in metrics.items():
            scalar = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
            sums[name] = sums.get(name, 0.0) + scalar * num_tokens
            weights[name] = weights.get(name, 0.0) + num_tokens
    averaged = {name: sums[name] / weights[name] if weights[name] > 0 else 0.0 for name in sums}
    assert total is not None
    return total, averaged


VOCAB, HIDDEN, PROMPT, RESP = 11, 8, 3, 6
MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1],
        [1, 1, 0, 0, 1, 1],
        [1, 1, 1, 1, 0, 0],
    ],
    dtype=torch.float64,
)
B = MASK.shape[0]


class TinyLM(nn.Module):
    """Embedding -> causal prefix mean -> MLP -> (vocab logits, value)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)
        self.value_head = nn.Linear(HIDDEN, 1)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(input_ids)
        steps = torch.arange(1, input_ids.shape[1] + 1, dtype=h.dtype)
        h = torch.tanh(self.mix(h.cumsum(dim=1) / steps[None, :, None]))
        return self.lm_head(h), self.value_head(h).squeeze(-1)


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().double()


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (B, PROMPT + RESP), generator=g)
    with torch.no_grad():
        logits, values = make_model()(input_ids)
        logp = logprobs_from_logits(logits[:, PROMPT - 1 : -1], input_ids[:, PROMPT:])
    noise = lambda scale: torch.randn(B, RESP, generator=g, dtype=torch.float64) * scale  # noqa: E731
    return {
        "input_ids": input_ids,
        "response_mask": MASK,
        "old_log_prob": logp + noise(0.3),  # ratios spread enough to hit both clip branches
        "ref_log_prob": logp + noise(0.5),
        "advantages": noise(1.0),
        "values": values[:, PROMPT - 1 : -1] + noise(0.1),
        "returns": noise(1.0),
    }


def loss_fn(model: TinyLM, mode: str, terms: str, policy: str = "vanilla"):
    def fn(mb: dict[str, torch.Tensor], norm: LossNormalizer):
        logits, values = model(mb["input_ids"])
        resp_logits = logits[:, PROMPT - 1 : -1]
        mask = mb["response_mask"]
        metrics: dict[str, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float64)
        if terms in ("policy", "all"):
            logp = logprobs_from_logits(resp_logits, mb["input_ids"][:, PROMPT:])
            pg, metrics = POLICY_LOSSES[policy](
                PolicyLossInputs(
                    old_log_prob=mb["old_log_prob"],
                    log_prob=logp,
                    advantages=mb["advantages"],
                    response_mask=mask,
                    clip_ratio_low=0.2,
                    clip_ratio_high=0.28,
                    clip_ratio_c=3.0,
                    normalizer=norm,
                    loss_agg_mode=mode,
                )
            )
            total = total + pg
        if terms == "all":
            kl = aggregate_loss(kl_penalty(logp, mb["ref_log_prob"], "low_var_kl+"), mask, mode, norm)
            entropy = aggregate_loss(entropy_from_logits(resp_logits), mask, mode, norm)
            total = total + 0.1 * kl - 0.01 * entropy
        if terms in ("value", "all"):
            vf, vf_metrics = compute_value_loss(
                vpreds=values[:, PROMPT - 1 : -1],
                returns=mb["returns"],
                values=mb["values"],
                response_mask=mask,
                cliprange_value=0.05,
                normalizer=norm,
                loss_agg_mode=mode,
            )
            total, metrics = total + 0.5 * vf, {**metrics, **vf_metrics}
        return total, metrics

    return fn


def accumulated(mode: str, terms: str, policy: str, micro_batch_size: int):
    model, batch = make_model(), make_batch()
    norm = LossNormalizer.from_mask(batch["response_mask"], norm_constant=RESP)
    micro = split_micro_batches(batch, micro_batch_size)
    loss, metrics = backward_micro_batches(micro, loss_fn(model, mode, terms, policy), norm)
    return (
        loss,
        metrics,
        [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()],
    )


CASES = [
    ("policy", "vanilla"),
    ("policy", "gspo"),
    ("policy", "gpg"),
    ("value", "vanilla"),
    ("all", "vanilla"),
    ("all", "gspo"),
]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("terms", "policy"), CASES)
def test_gradient_is_invariant_to_micro_batch_size(mode, terms, policy):
    full_loss, full_metrics, full_grads = accumulated(mode, terms, policy, B)
    assert any(g.abs().max() > 1e-6 for g in full_grads)
    for size in (1, 2, 3):
        loss, metrics, grads = accumulated(mode, terms, policy, size)
        torch.testing.assert_close(loss, full_loss, rtol=0, atol=1e-12)
        for g, ref in zip(grads, full_grads):
            torch.testing.assert_close(g, ref, rtol=0, atol=1e-12)
        for name, value in full_metrics.items():  # token-weighted metric averages are exact too
            assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-9)


def test_clipping_branches_are_exercised():
    _, metrics, _ = accumulated("token-mean", "all", "vanilla", B)
    assert 0 < metrics["pg_clipfrac"] < 1 and 0 < metrics["vf_clipfrac"] < 1


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_naive_per_micro_batch_mean_differs(mode):
    """What peers did: normalise each micro-batch by its own counts, then divide by the number of micro-batches."""
    _, _, full_grads = accumulated(mode, "all", "vanilla", B)
    model, batch = make_model(), make_batch()
    micro = split_micro_batches(batch, 2)
    fn = loss_fn(model, mode, "all")
    for mb in micro:
        local = LossNormalizer.from_mask(mb["response_mask"], norm_constant=RESP)
        loss, _ = fn(mb, local)
        (loss / len(micro)).backward()
    diff = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), full_grads))
    assert diff > 1e-4


def test_data_parallel_average_equals_single_process():
    """Two ranks, global counts and dp_size=2, gradients averaged as DDP/FSDP do."""
    mode, batch = "seq-mean-token-mean", make_batch()
    _, _, full_grads = accumulated(mode, "all", "vanilla", B)
    halves = [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
    local = [LossNormalizer.from_mask(h["response_mask"], RESP) for h in halves]
    norm = LossNormalizer(
        num_tokens=sum(n.num_tokens for n in local),
        num_sequences=sum(n.num_sequences for n in local),
        norm_constant=RESP,
        dp_size=2,
    )
    rank_grads = []
    for half in halves:
        model = make_model()
        backward_micro_batches(split_micro_batches(half, 2), loss_fn(model, mode, "all"), norm)
        rank_grads.append([p.grad for p in model.parameters()])
    for a, b, ref in zip(*rank_grads, full_grads):
        torch.testing.assert_close((a + b) / 2, ref, rtol=0, atol=1e-12)


def test_split_micro_batches_shapes_and_errors():
    batch = make_batch()
    parts = split_micro_batches(batch, 3)
    assert [p["input_ids"].shape[0] for p in parts] == [3, 3, 1]
    assert all(set(p) == set(batch) for p in parts)
    torch.testing.assert_close(torch.cat([p["advantages"] for p in parts]), batch["advantages"])
    assert len(split_micro_batches(batch, 100)) == 1
    with pytest.raises(ValueError, match="micro_batch_size"):
        split_micro_batches(batch, 0)
    with pytest.raises(ValueError, match="same number of rows"):
        split_micro_batches({"a": torch.zeros(2, 3), "b": torch.zeros(3)}, 1)
    with pytest.raises(ValueError, match="tensor"):
        split_micro_batches({"a": [1, 2]}, 1)
