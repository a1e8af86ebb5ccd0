"""Throughput switches change how a step is computed, never what: gradients and outputs are identical.

One mini-batch of a real RolloutBatch (variable prompt and response lengths: left-padded prompts, right-padded
responses) on a tiny fp32 Qwen2 goes through the trainer's own code (engine.micro_batches.accumulate_and_step /
micro_batch_rows / forward_in_micro_batches with engine.roles.actor_loss_fn / critic_loss_fn) under every
combination of {padded, packed} x {1, 2, 4 rows per micro-batch, token budgets incl. the minimal one}. The
gradient of one optimizer step of the GRPO policy loss (with KL loss and entropy bonus) and of the PPO value loss,
and the forward-only outputs (old/ref log-probs, values, in the original row order), must equal the padded,
single-micro-batch reference. The chunked log-prob head (with and without recompute) and gradient checkpointing
are held to the same standard.
"""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.batching.micro import micro_batch_rows
from posttrain.config.schema import ActorConfig, CriticConfig
from posttrain.data.batch import RolloutBatch, build_rollout_batch
from posttrain.forward.passes import ForwardOptions, critic_values, policy_logprobs
from posttrain.models.critic import CriticModel
from posttrain.models.prepare import enable_gradient_checkpointing
from posttrain.train.losses import actor_loss_fn, critic_loss_fn
from posttrain.train.update import accumulate_and_step, forward_in_micro_batches
from tests.helpers import GradCapture, assert_grads_equal, tiny_qwen2_config

VOCAB = 96
PROMPT_LENS = [5, 9, 3, 12, 7, 4, 10, 6]
RESPONSE_LENS = [6, 1, 11, 3, 8, 2, 9, 5]
TEMPERATURE = 0.7
PADDED = ForwardOptions()
PACKED = ForwardOptions(remove_padding=True, max_row_tokens=24)  # several rows, several sequences per row
LONGEST = max(p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS))
SPLITS = {  # name -> (micro-batch size, token budget)
    "micro1": (1, None),
    "micro2": (2, None),
    "micro4": (4, None),
    "budget_min": (None, LONGEST),  # the smallest budget the plan accepts: the longest sequence
    "budget_2x": (None, 2 * LONGEST),
    "budget_all": (None, sum(PROMPT_LENS) + sum(RESPONSE_LENS)),
}
ACTOR_CFG = ActorConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01, clip_ratio_low=0.2)
CRITIC_CFG = CriticConfig(cliprange_value=0.2)


def tiny_config() -> Qwen2Config:
    return tiny_qwen2_config(VOCAB, max_position_embeddings=128)


def tiny_policy() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(tiny_config(), attn_implementation="sdpa").float()


def tiny_critic() -> CriticModel:
    torch.manual_seed(1)
    backbone = Qwen2Model._from_config(tiny_config(), attn_implementation="sdpa").float()
    return CriticModel(backbone, init_std=0.1)  # a non-zero head so the backbone gets gradients


def rollout_batch() -> RolloutBatch:
    """Two groups of four samples with the fields a training step fills before the updates."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    batch = build_rollout_batch(prompts, responses, [0, 0, 0, 0, 1, 1, 1, 1], pad_token_id=0)
    mask = batch.response_mask
    with torch.no_grad():
        logp, _ = policy_logprobs(tiny_policy(), batch, temperature=TEMPERATURE)
    noise = lambda scale: torch.randn(mask.shape, generator=g) * scale * mask  # noqa: E731
    batch.old_log_probs = logp * mask + noise(0.3)  # ratios spread enough to hit both clip branches
    batch.ref_log_probs = logp * mask + noise(0.5)
    batch.advantages = noise(1.0)
    batch.values = noise(0.5)
    batch.returns = noise(1.0)
    return batch


def one_step(module, loss_fn, split: str) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The gradient and metrics of one optimizer step on the mini-batch, as the trainer computes them."""
    batch = rollout_batch()
    micro, budget = SPLITS[split]
    rows = micro_batch_rows(batch, micro, budget)
    if budget is not None:
        assert all(sum(batch.seq_lens()[i] for i in r) <= budget for r in rows)
    optimizer = GradCapture(module.parameters())
    module.train()
    normalizer = LossNormalizer.from_mask(batch.response_mask, norm_constant=batch.response_width)
    metrics = accumulate_and_step(module, optimizer, None, batch, rows, loss_fn, normalizer, grad_clip=0.0)
    assert metrics["micro_batches"] == len(rows)
    return optimizer.grads, metrics


@pytest.fixture(scope="module")
def actor_reference():
    model = tiny_policy()
    return one_step(model, actor_loss_fn(model, ACTOR_CFG, TEMPERATURE, PADDED), "budget_all")


@pytest.fixture(scope="module")
def critic_reference():
    critic = tiny_critic()
    return one_step(critic, critic_loss_fn(critic, CRITIC_CFG, PADDED), "budget_all")


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_actor_gradient_identical(actor_reference, layout, split):
    model = tiny_policy()
    options = PACKED if layout == "packed" else PADDED
    grads, metrics = one_step(model, actor_loss_fn(model, ACTOR_CFG, TEMPERATURE, options), split)
    ref_grads, ref_metrics = actor_reference
    assert_grads_equal(grads, ref_grads, f"actor {layout} {split}")
    for key in ("loss", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
    assert 0 < ref_metrics["actor/pg_clipfrac"] < 1


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_critic_gradient_identical(critic_reference, layout, split):
    critic = tiny_critic()
    options = PACKED if layout == "packed" else PADDED
    grads, metrics = one_step(critic, critic_loss_fn(critic, CRITIC_CFG, options), split)
    ref_grads, ref_metrics = critic_reference
    assert_grads_equal(grads, ref_grads, f"critic {layout} {split}")
    for key in ("loss", "critic/vf_clipfrac", "critic/vpred_mean"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_forward_only_outputs_identical_and_in_order(layout):
    """Old/ref log-probs and values: every split gives the padded whole-batch result, row for row."""
    batch, model, critic = rollout_batch(), tiny_policy().eval(), tiny_critic().eval()
    mask = batch.response_mask
    options = PACKED if layout == "packed" else PADDED
    with torch.no_grad():
        ref_logp = policy_logprobs(model, batch, temperature=TEMPERATURE)[0] * mask
        ref_values = critic_values(critic, batch) * mask
    # Row i alone gives row i of the whole batch: the reference itself is in order.
    single = policy_logprobs(model, batch.select([5]).trimmed(), temperature=TEMPERATURE)[0]
    torch.testing.assert_close(
        single[0, : RESPONSE_LENS[5]], ref_logp[5, : RESPONSE_LENS[5]], rtol=0, atol=1e-5
    )
    for micro, budget in SPLITS.values():
        logp = forward_in_micro_batches(
            lambda mb: policy_logprobs(model, mb, temperature=TEMPERATURE, options=options)[0],
            batch,
            micro,
            budget,
            torch.device("cpu"),
        )
        values = forward_in_micro_batches(
            lambda mb: critic_values(critic, mb, options), batch, micro, budget, torch.device("cpu")
        )
        torch.testing.assert_close(logp * mask, ref_logp, rtol=0, atol=2e-5)
        torch.testing.assert_close(values * mask, ref_values, rtol=0, atol=2e-5)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["no_recompute", "recompute"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_chunked_head_equals_full_logits(actor_reference, layout, checkpoint):
    """actor.entropy_from_logits_with_chunking (+ entropy_checkpointing): same log-probs, entropy and grads."""
    batch = rollout_batch()
    options = ForwardOptions(
        remove_padding=layout == "packed",
        max_row_tokens=24,
        logprob_chunk_size=7,
        chunk_checkpoint=checkpoint,
    )
    model = tiny_policy()
    with torch.no_grad():
        full = policy_logprobs(model, batch, temperature=TEMPERATURE, with_entropy=True)
        chunked = policy_logprobs(model, batch, temperature=TEMPERATURE, with_entropy=True, options=options)
    mask = batch.response_mask
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a * mask, b * mask, rtol=0, atol=2e-5)
    grads, _ = one_step(model, actor_loss_fn(model, ACTOR_CFG, TEMPERATURE, options), "micro2")
    assert_grads_equal(grads, actor_reference[0], f"chunked {layout} checkpoint={checkpoint}")


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_gradient_checkpointing_gives_identical_grads(actor_reference, critic_reference, role):
    """model/critic.enable_gradient_checkpointing: recomputing activations changes nothing (padded and packed)."""
    for options in (PADDED, PACKED):
        module = tiny_policy() if role == "actor" else tiny_critic()
        enable_gradient_checkpointing(module)
        backbone = module.backbone if role == "critic" else module.model
        assert backbone.gradient_checkpointing
        fn = (
            actor_loss_fn(module, ACTOR_CFG, TEMPERATURE, options)
            if role == "actor"
            else critic_loss_fn(module, CRITIC_CFG, options)
        )
        grads, _ = one_step(module, fn, "micro2")
        ref = actor_reference[0] if role == "actor" else critic_reference[0]
        assert_grads_equal(grads, ref, f"{role} gradient checkpointing")


def test_packed_forward_really_packs():
    """The packed path runs fewer positions than the padded one, in several rows of bounded length."""
    from posttrain.batching.packing import pack_sequences

    batch = rollout_batch()
    seqs = [batch.input_ids[i][batch.attention_mask[i].bool()] for i in range(batch.num_rows)]
    packed = pack_sequences(seqs, max(PACKED.max_row_tokens, LONGEST))
    assert 1 < packed.num_rows < batch.num_rows
    assert packed.num_rows * packed.row_len < batch.input_ids.numel()
    assert copy.copy(PACKED) == PACKED  # options are frozen values


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_actor_gradient_identical_in_every_aggregation_mode(mode, policy_loss):
    """The trainer's loop keeps the mini-batch's global denominators for every mode, however it is split."""
    cfg = ActorConfig(
        use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01, loss_agg_mode=mode, policy_loss=policy_loss
    )
    model = tiny_policy()
    ref, _ = one_step(model, actor_loss_fn(model, cfg, TEMPERATURE, PADDED), "budget_all")
    for split in ("micro1", "micro2", "budget_min"):
        grads, _ = one_step(model, actor_loss_fn(model, cfg, TEMPERATURE, PADDED), split)
        assert_grads_equal(grads, ref, f"{mode}/{policy_loss}/{split}")
