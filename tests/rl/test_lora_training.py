"""LoRA end to end: RL and SFT train only the adapters, the reference is the base model, resume is exact,
exports load outside posttrain, and the throughput switches still give the same numbers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models.hf import load_causal_lm
from posttrain.models.lora import AdaptersDisabled, adapter_parameters, is_lora_model
from posttrain.rl import train_command as rl
from posttrain.rl.eval_command import run_eval_command
from posttrain.rl.train_command import run_training
from posttrain.sft.command import run_sft_command
from posttrain.train.checkpoint import list_checkpoints
from tests.helpers import crash_and_resume, read_metrics, sft_config, small_config

from .test_throughput_options import all_on  # noqa: TID252

pytestmark = [
    pytest.mark.filterwarnings("ignore:model.lora_rank=.*ranks below 32:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:.*is_gradient_checkpointing.*:FutureWarning"
    ),  # peft asks transformers
]
LORA = ["model.lora_rank=8", "model.lora_alpha=16", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"]


def run_capturing(cfg, monkeypatch):
    """Run training; return the Components it built (to inspect the live policy afterwards)."""
    captured = {}
    original = rl.build_components

    def capture(*args, **kwargs):
        captured["c"] = c = original(*args, **kwargs)
        captured["before"] = {k: v.clone() for k, v in c.actor.module.state_dict().items()}
        return c

    monkeypatch.setattr(rl, "build_components", capture)
    run_training(cfg, quiet=True)
    return captured["c"], captured["before"]


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_rl_trains_only_the_adapters(tiny_model_dir, tmp_path, monkeypatch):
    from peft import PeftModel

    c, before = run_capturing(small_config(tiny_model_dir, tmp_path / "run", *LORA), monkeypatch)
    policy = c.actor.module
    assert is_lora_model(policy) and isinstance(c.ref, AdaptersDisabled) and c.ref.policy is policy
    adapters = {n for n, _ in adapter_parameters(policy)}
    after = policy.state_dict()
    for name, tensor in after.items():
        changed = not torch.equal(tensor, before[name])
        assert changed == (name in adapters), name  # base bit-identical, every adapter tensor trained
    metrics = read_metrics(tmp_path / "run")
    assert metrics[-1]["actor/kl_loss"] > 0 and metrics[0]["actor/grad_norm"] > 0
    from posttrain.train.sharded_state import saved_shapes

    stored = saved_shapes(list_checkpoints(tmp_path / "run")[-1] / "state")
    weights = {n.removeprefix("actor.model.") for n in stored if n.startswith("actor.model.")}
    # The checkpoint holds the adapters, not the base (but for the tied head's second name, a DCP quirk).
    assert adapters <= weights and weights - adapters <= {"base_model.model.lm_head.weight"}
    out = tmp_path / "run" / "final_model"
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    ids = torch.tensor([[5, 17, 30, 41, 2, 9]])
    torch.testing.assert_close(logits(loaded, ids), logits(policy, ids), rtol=0, atol=1e-5)


def test_merged_export_is_a_plain_model(tiny_model_dir, tmp_path, monkeypatch):
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", *LORA, "trainer.total_steps=1", "trainer.export_merged=true"
    )
    c, _ = run_capturing(cfg, monkeypatch)
    out = tmp_path / "run" / "final_model"
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 17, 30, 41, 2, 9], [7, 7, 8, 100, 3, 1]])
    torch.testing.assert_close(logits(merged, ids), logits(c.actor.module, ids), rtol=0, atol=1e-5)
    assert not torch.equal(logits(merged, ids), logits(load_causal_lm(tiny_model_dir), ids))
    assert run_eval_command(cfg, model_path=str(out))["val/accuracy"] >= 0.0  # posttrain eval reads it


def test_resume_with_lora_continues_exactly(tiny_model_dir, tmp_path, monkeypatch):
    keys = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "response_length/mean")
    cfg = crash_and_resume(tiny_model_dir, tmp_path, monkeypatch, LORA, keys)
    from safetensors.torch import load_file

    a = load_file(tmp_path / "full" / "final_model" / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "final_model" / "adapter_model.safetensors")
    assert set(a) == set(b) and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)
    # posttrain eval on a LoRA checkpoint wraps the base model the same way before loading the adapters.
    ckpt = list_checkpoints(tmp_path / "resumed")[-1]
    assert 0.0 <= run_eval_command(cfg, model_path=str(ckpt))["val/accuracy"] <= 1.0


@pytest.fixture(scope="module")
def plain_lora_step(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_plain") / "run"
    run_training(small_config(tiny_model_dir, run_dir, *LORA, "trainer.total_steps=1"), quiet=True)
    return read_metrics(run_dir)[0]


SWITCHES = {
    "remove_padding": lambda cfg: ["model.use_remove_padding=true", "model.remove_padding_max_row_tokens=64"],
    "dynamic_bsz": lambda cfg: [o for o in all_on(cfg) if "dynamic_bsz" in o or "max_token_len" in o],
    "gradient_checkpointing": lambda cfg: ["model.enable_gradient_checkpointing=true"],
    "chunked_head": lambda cfg: [o for o in all_on(cfg) if "entropy" in o],
}


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_lora_with_throughput_switches_matches_plain(tiny_model_dir, tmp_path, plain_lora_step, switch):
    base = small_config(tiny_model_dir, tmp_path / "run", *LORA, "trainer.total_steps=1")
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", *LORA, "trainer.total_steps=1", *SWITCHES[switch](base)
    )
    run_training(cfg, quiet=True)
    on = read_metrics(tmp_path / "run")[0]
    assert on["reward/mean"] == plain_lora_step["reward/mean"]  # the same rollout
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac"):
        assert on[key] == pytest.approx(plain_lora_step[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_sft_with_lora_trains_adapters_and_exports(tiny_model_dir, tmp_path, monkeypatch, merge):
    from peft import PeftModel

    from posttrain.sft import command as sft

    trained = {}
    original = sft.prepare_sft

    def capture(cfg, model, *args, **kwargs):
        trained["model"] = model
        return original(cfg, model, *args, **kwargs)

    monkeypatch.setattr(sft, "prepare_sft", capture)
    extra = [
        "model.lora_rank=8",
        "model.lora_alpha=16",
        "sft.optim.lr=1e-2",
        f"trainer.export_merged={merge}",
    ]
    out = run_sft_command(sft_config(tiny_model_dir, tmp_path, *extra))
    policy, fresh = trained["model"], load_causal_lm(tiny_model_dir)
    assert is_lora_model(policy)
    base_after = {
        k.replace(".base_layer", ""): v
        for k, v in policy.get_base_model().state_dict().items()
        if "lora_" not in k
    }
    assert all(torch.equal(base_after[k], v) for k, v in fresh.state_dict().items())  # the base stayed frozen
    exported = AutoModelForCausalLM.from_pretrained(out) if merge else PeftModel.from_pretrained(fresh, out)
    ids = torch.tensor([[5, 17, 30, 41, 2, 9]])
    trained_logits = logits(policy, ids)
    assert not torch.allclose(trained_logits, logits(load_causal_lm(tiny_model_dir), ids), atol=1e-3)
    torch.testing.assert_close(logits(exported, ids), trained_logits, rtol=0, atol=1e-5)
