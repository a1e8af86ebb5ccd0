"""actor.use_prefix_grouper: computing a shared prompt once changes how a pass runs, never its numbers.

A batch of three prompts answered four times each (plus a prompt answered once, an empty response and a
response-less row), variable lengths, on tiny fp32 models: the grouped forward's log-probs, entropy and values,
and the gradient of one optimizer step of the GRPO loss (KL + entropy) under several micro-batch splits, must
equal the padded single-micro-batch reference. Also: the layout itself (positions, what each token may see,
where each prediction sits), another architecture, LoRA, gradient checkpointing, and the refusals.

Numbers compare fp32-close (tests.helpers: the grouped pass runs other shapes in another order), the layout
exactly."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.batching.micro import micro_batch_rows, rank_micro_batches, rank_rows
from posttrain.config.schema import ActorConfig
from posttrain.data.batch import RolloutBatch, build_rollout_batch
from posttrain.forward.passes import ForwardOptions, critic_values, policy_logprobs
from posttrain.forward.prefix_grouper import group_by_prompt
from posttrain.forward.shared_prefix import register_shared_prefix_attention
from posttrain.models.critic import CriticModel
from posttrain.parallel.data_parallel import DataParallel
from posttrain.train.losses import actor_loss_fn
from posttrain.train.update import accumulate_and_step
from tests.helpers import GradCapture, assert_fp32_close, assert_grads_equal

pytestmark = pytest.mark.numerics  # runs again under other CPU instruction sets in CI

VOCAB = 96
TEMPERATURE = 0.7
PADDED = ForwardOptions()
GROUPED = ForwardOptions(prefix_grouper=True)
ACTOR_CFG = ActorConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)


def tiny_model(arch: str = "qwen2", attn: str | None = None, **extra) -> torch.nn.Module:
    """The grouped passes need the shared-prefix attention; it runs sdpa in every plain call."""
    attn = attn or register_shared_prefix_attention()
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **extra,
    )
    if arch == "llama":
        return LlamaForCausalLM._from_config(LlamaConfig(**common), attn_implementation=attn).float()
    return Qwen2ForCausalLM._from_config(
        Qwen2Config(**common, tie_word_embeddings=True), attn_implementation=attn
    ).float()


def grouped_batch() -> RolloutBatch:
    """Rows in shuffled order: prompts A (x4), B (x4), C (x4, one with an empty response), D (x1), E (x2, short
    enough to share a row with another segment)."""
    g = torch.Generator().manual_seed(3)
    prompt = {
        name: torch.randint(1, VOCAB, (n,), generator=g).tolist()
        for name, n in zip("ABCDE", (5, 11, 3, 8, 2))
    }
    order = list("ABCABCDABCEABCE")
    lengths = [6, 1, 9, 3, 7, 2, 5, 8, 4, 0, 1, 2, 6, 3, 2]
    prompts = [prompt[name] for name in order]
    responses = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    groups = ["ABCDE".index(name) for name in order]
    batch = build_rollout_batch(prompts, responses, groups, pad_token_id=0)
    mask = batch.response_mask
    with torch.no_grad():
        logp, _ = policy_logprobs(tiny_model(), batch, temperature=TEMPERATURE)
    noise = lambda scale: torch.randn(mask.shape, generator=g) * scale * mask  # noqa: E731
    batch.old_log_probs = logp * mask + noise(0.3)
    batch.ref_log_probs = logp * mask + noise(0.5)
    batch.advantages = noise(1.0)
    return batch


def test_layout_shares_each_prompt_and_restarts_positions():
    batch = grouped_batch()
    groups = group_by_prompt(batch)
    assert groups.input_ids.shape[0] == 1  # one flat row
    plain_tokens = int(batch.attention_mask.sum())
    assert groups.prompt_tokens_saved == 3 * 5 + 3 * 11 + 3 * 3 + 2  # the repeated prompts of A, B, C and E
    assert groups.input_ids.numel() == plain_tokens - groups.prompt_tokens_saved  # no padding at all
    # Each prediction reads the token before the predicted one, at the position the plain row gives it.
    p = batch.prompt_width
    for i in range(batch.num_rows):
        for t in range(int(batch.response_mask[i].sum())):
            r, c = int(groups.rows[i, t]), int(groups.cols[i, t])
            assert groups.input_ids[r, c] == batch.input_ids[i, p + t - 1]
            assert groups.position_ids[r, c] == batch.position_ids[i, p + t - 1]
    # A response token sees its prompt and its own earlier tokens: exactly the tokens of its plain row before it.
    plan = groups.attention
    row = groups.input_ids[0]
    flat = {}  # flat column -> (response, query slot)
    for s_, tokens in enumerate(plan.response_tokens.tolist()):
        for q, col in enumerate(tokens):
            flat.setdefault(col, (s_, q))
    for i in range(batch.num_rows):
        n = int(batch.response_mask[i].sum())
        for t in range(1, n):
            s_, q = flat[int(groups.cols[i, t])]
            seen = plan.response_keys[s_][plan.response_mask[s_, 0, q]]
            plain = batch.input_ids[i][batch.attention_mask[i].bool()][
                : int(batch.position_ids[i, p + t - 1]) + 1
            ]
            assert row[seen].tolist() == plain.tolist()
    # Every token's output comes from exactly one query slot.
    assert plan.output_index.unique().numel() == plan.output_index.numel() == row.numel()


def test_gradient_checkpointing_keeps_the_grouped_gradient():
    """Backward recomputes each layer's forward: it must run the shared-prefix attention again (the plan travels
    with the layer's arguments), or the gradients would be those of one causal sequence."""
    ref_grads, _ = one_step(PADDED, None, 10_000)
    model = tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    grads, _ = one_step(GROUPED, 4, None, model=model)
    assert_grads_equal(grads, ref_grads, "grouped with gradient checkpointing")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logprobs_entropy_and_values_equal_padded(arch):
    batch = grouped_batch()
    model = tiny_model(arch).eval()
    with torch.no_grad():
        ref_lp, ref_ent = policy_logprobs(model, batch, temperature=TEMPERATURE, with_entropy=True)
        lp, ent = policy_logprobs(model, batch, temperature=TEMPERATURE, with_entropy=True, options=GROUPED)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(lp[mask], ref_lp[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[mask], ref_ent[mask], rtol=1e-5, atol=1e-5)
    assert torch.all(lp[~mask] == 0)
    critic = CriticModel(model.get_decoder(), init_std=0.1)
    with torch.no_grad():
        ref_values = critic_values(critic, batch)
        values = critic_values(critic, batch, GROUPED)
    torch.testing.assert_close(values[mask], ref_values[mask], rtol=1e-5, atol=1e-5)


def test_sliding_window_layers_equal_padded():
    """A window shorter than the rows: each token sees only its own row's last few positions, prompt included."""
    batch = grouped_batch()
    window = dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)  # every layer windowed
    with torch.no_grad():
        ref_lp, _ = policy_logprobs(tiny_model(**window).eval(), batch, temperature=TEMPERATURE)
        lp, _ = policy_logprobs(tiny_model(**window).eval(), batch, temperature=TEMPERATURE, options=GROUPED)
        full, _ = policy_logprobs(tiny_model().eval(), batch, temperature=TEMPERATURE, options=GROUPED)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(lp[mask], ref_lp[mask], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(full[mask], ref_lp[mask], atol=1e-3)  # the window matters in this batch


def one_step(options: ForwardOptions, micro: int | None, budget: int | None, model=None, rows=None):
    batch = grouped_batch()
    model = model if model is not None else tiny_model()
    model.train()
    optimizer = GradCapture(p for p in model.parameters() if p.requires_grad)
    normalizer = LossNormalizer.from_mask(batch.response_mask, norm_constant=batch.response_width)
    rows = rows if rows is not None else micro_batch_rows(batch, micro, budget)
    loss_fn = actor_loss_fn(model, ACTOR_CFG, TEMPERATURE, options)
    metrics = accumulate_and_step(model, optimizer, None, batch, rows, loss_fn, normalizer, grad_clip=0.0)
    return optimizer.grads, metrics


@pytest.mark.parametrize("micro,budget", [(None, 10_000), (4, None), (1, None), (None, 30)])
def test_update_gradient_equals_padded(micro, budget):
    ref_grads, ref_metrics = one_step(PADDED, None, 10_000)
    grads, metrics = one_step(GROUPED, micro, budget)
    assert_grads_equal(grads, ref_grads, f"grouped micro={micro} budget={budget}")
    for key in ("loss", "actor/pg_loss", "actor/entropy", "actor/kl_loss"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key


def test_lora_adapter_gradient_equals_padded():
    from peft import LoraConfig, get_peft_model

    def lora_model():
        torch.manual_seed(5)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        return get_peft_model(tiny_model(), config)

    ref_grads, _ = one_step(PADDED, None, 10_000, model=lora_model())
    grads, _ = one_step(GROUPED, 4, None, model=lora_model())
    for g, r in zip(grads, ref_grads, strict=True):
        assert_fp32_close(g, r)


def test_an_sdpa_model_is_switched_and_other_attention_is_refused():
    batch = grouped_batch()
    model = tiny_model(attn="sdpa").eval()
    with torch.no_grad():
        policy_logprobs(model, batch, options=GROUPED)
    assert model.config._attn_implementation == "posttrain_shared_prefix"  # sdpa in every other call
    with pytest.raises(
        ValueError, match="attn_implementation='posttrain_shared_prefix'.* or 'sdpa', it uses 'eager'"
    ):
        policy_logprobs(tiny_model(attn="eager"), batch, options=GROUPED)


def test_plain_calls_of_the_shared_prefix_model_equal_sdpa():
    """Loaded for the grouper, the model's every other call (padded rows, rollout fallbacks) is sdpa's."""
    batch = grouped_batch()
    with torch.no_grad():
        ours, _ = policy_logprobs(tiny_model().eval(), batch, temperature=TEMPERATURE)
        sdpa, _ = policy_logprobs(tiny_model(attn="sdpa").eval(), batch, temperature=TEMPERATURE)
    assert torch.equal(ours, sdpa)


def test_row_without_prompt_is_refused():
    batch = build_rollout_batch([[5, 6], []], [[7], [8]], [0, 1], pad_token_id=0)
    with pytest.raises(ValueError, match="no prompt token"):
        group_by_prompt(batch)


def test_data_parallel_ranks_get_whole_groups_when_counts_allow():
    batch = build_rollout_batch(
        [[1, 2]] * 4 + [[3]] * 4 + [[4, 5, 6]] * 4 + [[7]] * 4,
        [[9] * k for k in range(1, 17)],
        [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4,
        pad_token_id=0,
    )
    shares = rank_rows(batch, DataParallel(dp_size=2, keep_groups=True))
    assert sorted(len(s) for s in shares) == [8, 8]
    for share in shares:
        groups = [int(batch.group_ids[i]) for i in share]
        assert all(groups.count(g) == 4 for g in groups)  # every group on a rank is there whole
    # Three groups cannot be split equally over two ranks: samples are balanced one by one instead.
    three = batch.select(list(range(12)))
    assert sorted(len(s) for s in rank_rows(three, DataParallel(dp_size=2, keep_groups=True))) == [6, 6]


def test_token_budget_keeps_a_prompts_samples_together():
    """With the grouper, token-budget micro-batches pack whole prompt groups (cut only where a group alone
    exceeds the budget) under the same hard cap on plain tokens, and the gradient stays the plain one."""
    batch = grouped_batch()
    lens, groups = batch.seq_lens(), batch.group_ids.tolist()
    budget = 40
    _, micro = rank_micro_batches(batch, DataParallel(keep_groups=True), None, budget)
    assert sorted(i for m in micro for i in m) == list(range(batch.num_rows))
    assert all(sum(lens[i] for i in m) <= budget for m in micro)
    for g in set(groups):
        rows = [i for i in range(batch.num_rows) if groups[i] == g]
        holders = {k for k, m in enumerate(micro) for i in m if i in rows}
        if sum(lens[i] for i in rows) <= budget:
            assert len(holders) == 1, f"prompt {g} fits the budget but was split over {holders}"
    ref_grads, _ = one_step(PADDED, None, 10_000)
    grads, _ = one_step(GROUPED, None, None, rows=micro)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_fp32_close(g, r)
