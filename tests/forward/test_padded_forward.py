"""The padded forward stops one position short (the last position predicts no response token) and runs the last
layer's MLP on the predicting columns only: log-probs, entropies, values and every gradient equal those of the
full-width forward, fp32-close (tests.helpers.assert_fp32_close): the narrowed last MLP and the shorter
body run matmuls of other shapes, which sum in another order; bit-exact is not to be had."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from posttrain.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from posttrain.data.batch import build_rollout_batch
from posttrain.forward.passes import critic_values, policy_logprobs, response_hidden_states
from posttrain.models.critic import CriticModel
from tests.helpers import assert_fp32_close, tiny_qwen2_config

pytestmark = pytest.mark.numerics  # runs again under other CPU instruction sets in CI

VOCAB = 97


def _batch():
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    # ragged prompts (left padding) and responses (right padding), one empty response, one row full width
    prompts = [ids(n) for n in (5, 2, 7, 7, 3)]
    responses = [ids(n) for n in (6, 1, 0, 4, 6)]
    return build_rollout_batch(prompts, responses, [0, 0, 1, 1, 2], pad_token_id=0)


def _full_width_hidden(body, batch):
    """The reference: every position through the body, then the positions predicting response tokens."""
    out = body(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    p, r = batch.prompt_width, batch.response_width
    return out.last_hidden_state[:, p - 1 : p - 1 + r]


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_policy_logprobs_equal_the_full_width_forward(temperature):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(VOCAB), attn_implementation="sdpa").float()
    batch = _batch()
    mask = batch.response_mask

    logprobs, entropy = policy_logprobs(model, batch, temperature=temperature, with_entropy=True)
    ((logprobs * mask).sum() + (entropy * mask).sum()).backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)

    logits = model.lm_head(_full_width_hidden(model.get_decoder(), batch)).float() / temperature
    ref_logprobs, ref_entropy = logprobs_from_logits(logits, batch.responses), entropy_from_logits(logits)
    ((ref_logprobs * mask).sum() + (ref_entropy * mask).sum()).backward()

    assert_fp32_close(logprobs * mask, ref_logprobs * mask, ulps=16, msg="logprobs")
    assert_fp32_close(entropy * mask, ref_entropy * mask, ulps=16, msg="entropy")
    ref = _grads(model)
    assert got.keys() == ref.keys()
    for name in ref:
        assert_fp32_close(got[name], ref[name], msg=name)


def test_critic_values_equal_the_full_width_forward():
    torch.manual_seed(0)
    critic = CriticModel(
        AutoModel.from_config(tiny_qwen2_config(VOCAB), attn_implementation="sdpa").float(), init_std=0.1
    )
    batch = _batch()
    values = critic_values(critic, batch)
    (values * batch.response_mask).sum().backward()
    got = _grads(critic)
    critic.zero_grad(set_to_none=True)

    ref_values = critic.value_head(_full_width_hidden(critic.backbone, batch).float()).squeeze(-1)
    (ref_values * batch.response_mask).sum().backward()
    assert_fp32_close(values, ref_values, ulps=16, msg="values")
    ref = _grads(critic)
    for name in ref:
        assert_fp32_close(got[name], ref[name], msg=name)


def _mlp_widths(model):
    """Records the column count of every input the last layer's MLP computes on (its first projection's)."""
    widths = []
    mlp = model.get_decoder().layers[-1].mlp
    handle = mlp.gate_proj.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    return widths, handle, mlp


def test_the_last_mlp_runs_on_the_predicting_columns_only_and_its_hooks_leave():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(VOCAB), attn_implementation="sdpa").float()
    batch = _batch()
    widths, spy, mlp = _mlp_widths(model)
    response_hidden_states(model, batch)
    spy.remove()
    p, r = batch.prompt_width, batch.response_width
    assert widths == [r]  # columns p-1 .. p+r-2 of the p+r-1 the body runs
    assert p - 1 > 0
    assert not mlp._forward_pre_hooks and not mlp._forward_hooks

    def fail(module, args):
        raise RuntimeError("inside the last MLP")

    failing = mlp.gate_proj.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="inside the last MLP"):
        response_hidden_states(model, batch)
    failing.remove()
    assert not mlp._forward_pre_hooks and not mlp._forward_hooks


def test_with_gradient_checkpointing_the_last_mlp_is_left_whole():
    """Checkpointing re-runs the layer in backward outside the context: the narrowing must not happen then."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(VOCAB), attn_implementation="sdpa").float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = _batch()
    widths, spy, _ = _mlp_widths(model)
    logprobs, _ = policy_logprobs(model, batch, temperature=1.0)
    (logprobs * batch.response_mask).sum().backward()
    spy.remove()
    full = batch.prompt_width + batch.response_width - 1
    assert widths == [full, full]  # the forward and its recomputation
    assert all(p.grad is not None for p in model.parameters())
