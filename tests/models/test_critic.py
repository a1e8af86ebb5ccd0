"""The critic: backbone from the actor checkpoint + value head; packed rows equal padded rows; save/load."""

import pytest
import torch

from posttrain.models.critic import VALUE_HEAD_FILE, CriticModel
from posttrain.models.hf import load_causal_lm
from posttrain.models.tiny import create_tiny_model_dir

pytestmark = pytest.mark.numerics  # runs again under other CPU instruction sets in CI


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return create_tiny_model_dir(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_hidden_layers=2)


def _randomize_head(critic: CriticModel, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape, generator=gen))
        critic.value_head.bias.fill_(0.3)


def test_backbone_comes_from_actor_and_head_starts_at_zero(tiny_dir):
    critic = CriticModel.from_causal_lm_path(tiny_dir)
    actor = load_causal_lm(tiny_dir)
    actor_sd = actor.model.state_dict()
    for name, tensor in critic.backbone.state_dict().items():
        assert torch.equal(tensor, actor_sd[name]), name
    assert not hasattr(critic.backbone, "lm_head")
    values = critic(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    assert values.shape == (2, 3) and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0


def test_bf16_backbone_gives_float32_values(tiny_dir):
    critic = CriticModel.from_causal_lm_path(tiny_dir, dtype="bf16", init_std=0.02)
    assert critic.backbone.dtype == torch.bfloat16
    assert critic(torch.tensor([[5, 6, 7]])).dtype == torch.float32


def test_packed_rows_equal_padded_rows(tiny_dir):
    critic = CriticModel.from_causal_lm_path(tiny_dir)
    _randomize_head(critic)
    a, b = [11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27]
    pad = 0
    padded = torch.tensor([[pad] * 2 + a, b])  # left padding
    mask = torch.tensor([[0] * 2 + [1] * 5, [1] * 7])
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = torch.tensor([a + b])
    packed_pos = torch.tensor([list(range(5)) + list(range(7))])
    with torch.no_grad():
        v_pad = critic(padded, attention_mask=mask, position_ids=position_ids)
        v_pack = critic(packed, attention_mask=None, position_ids=packed_pos)
    torch.testing.assert_close(v_pack[0, :5], v_pad[0, 2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_pack[0, 5:], v_pad[1], atol=1e-5, rtol=1e-5)


def test_gradients_reach_backbone_once_head_is_nonzero(tiny_dir):
    critic = CriticModel.from_causal_lm_path(tiny_dir, init_std=0.05)
    critic(torch.tensor([[3, 4, 5, 6]])).square().mean().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0
    assert critic.backbone.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_save_and_reload(tiny_dir, tmp_path):
    critic = CriticModel.from_causal_lm_path(tiny_dir)
    _randomize_head(critic, seed=1)
    with torch.no_grad():
        critic.backbone.norm.weight.mul_(0.5)
    out = critic.save_pretrained(tmp_path / "critic")
    assert (out / VALUE_HEAD_FILE).is_file() and (out / "config.json").is_file()
    reloaded = CriticModel.from_pretrained(out)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids), critic(ids))


def test_errors(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="init_std"):
        CriticModel.from_causal_lm_path(tiny_dir, init_std=-1.0)
    with pytest.raises(ValueError, match=VALUE_HEAD_FILE):
        CriticModel.from_pretrained(tiny_dir)  # an actor dir, not a saved critic
    with pytest.raises(ValueError, match="dtype"):
        CriticModel.from_causal_lm_path(tiny_dir, dtype="int8")
