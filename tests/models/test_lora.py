"""LoRA through PEFT: the wrapped policy in every forward path, the reference view, weight streams, export,
checkpoints and the config rules. Tiny fp32 Qwen2 (tests/conftest.py), adapters set to non-zero values so that
"adapter on" and "adapter off" really differ."""

import copy
import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config.load import build_config
from posttrain.data.batch import build_rollout_batch
from posttrain.forward.passes import ForwardOptions, policy_logprobs
from posttrain.models.export import export_policy
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.models.lora import (
    adapter_parameters,
    adapter_state,
    apply_lora,
    check_lora_config,
    hf_model,
    is_lora_model,
    lora_memory,
    merged_state,
    policy_weights,
    reference_policy,
)
from posttrain.models.prepare import enable_gradient_checkpointing, read_model_config
from posttrain.planning.shape import ModelShape
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native.engine import NativeEngine
from posttrain.train.checkpoint import load_checkpoint, save_checkpoint
from posttrain.train.trainable import Trainable

pytestmark = [
    pytest.mark.filterwarnings("ignore:model.lora_rank=.*ranks below 32:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:.*is_gradient_checkpointing.*:FutureWarning"
    ),  # peft asks transformers
]
PADDED = ForwardOptions()
PACKED = ForwardOptions(remove_padding=True, max_row_tokens=24)
CHUNKED = ForwardOptions(logprob_chunk_size=5)


def lora_cfg(*extra):
    return build_config(overrides=["model.lora_rank=4", "model.lora_alpha=8", *extra])


def lora_policy(model_dir, *extra, seed=3):
    """(plain base copy, LoRA policy with non-zero adapters)."""
    base = load_causal_lm(model_dir)
    plain = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # rank < 32
        policy = apply_lora(base, lora_cfg(*extra))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_parameters(policy):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return plain, policy


def batch(vocab=300):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    responses = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (6, 1, 8, 4)]
    return build_rollout_batch(prompts, responses, [0, 0, 1, 1], pad_token_id=0)


def logprobs(model, options=PADDED, b=None):
    with torch.no_grad():
        return policy_logprobs(model, b or batch(), temperature=0.7, options=options)[0]


def test_only_adapters_are_trainable_and_optimized(tiny_model_dir):
    _, policy = lora_policy(tiny_model_dir)
    assert is_lora_model(policy)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in adapter_parameters(policy)} and trainable
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    opt = Trainable.create(policy, lora_cfg().actor.optim, 10).optimizer
    given = {id(p) for group in opt.param_groups for p in group["params"]}
    assert given == {id(p) for _, p in adapter_parameters(policy)}


def test_hugging_face_lookups_through_the_wrapper(tiny_model_dir):
    plain, policy = lora_policy(tiny_model_dir)
    assert type(policy.get_decoder()) is type(plain.get_decoder())  # Qwen2Model, adapters injected
    assert policy.config.model_type == "qwen2" and policy.get_output_embeddings() is hf_model(policy).lm_head
    # The trap hf_model() exists for: PEFT resolves `.model` to the whole causal LM, not the decoder body.
    assert type(policy.model) is type(plain) and hf_model(policy).model is policy.get_decoder()
    assert policy.lm_head is hf_model(policy).lm_head


@pytest.mark.parametrize("options", [PADDED, PACKED, CHUNKED], ids=["padded", "packed", "chunked"])
def test_reference_view_equals_the_base_model(tiny_model_dir, options):
    plain, policy = lora_policy(tiny_model_dir)
    policy.train()
    ref = reference_policy(policy)
    assert list(ref.parameters()) == []  # no copy of the weights
    base_lp = logprobs(plain, options)
    torch.testing.assert_close(logprobs(ref, options), base_lp, rtol=0, atol=1e-6)
    mask = batch().response_mask.bool()
    assert (logprobs(policy, options) - base_lp)[mask].abs().max() > 1e-3  # the adapters matter
    assert all(p.requires_grad for _, p in adapter_parameters(policy))  # restored after disable_adapter
    assert policy.training and all(m.training for m in policy.modules())  # the view restores the mode


def test_forward_paths_agree_with_adapters(tiny_model_dir):
    """Padded, packed and chunked-head passes of the PeftModel give the same log-probs and adapter gradients;
    so does gradient checkpointing (HF's, through the wrapper)."""
    results = {}
    for name, options, ckpt in [
        ("padded", PADDED, False),
        ("packed", PACKED, False),
        ("chunked", CHUNKED, False),
        ("checkpointed", PADDED, True),
    ]:
        _, policy = lora_policy(tiny_model_dir)
        if ckpt:
            enable_gradient_checkpointing(policy)
        policy.train()
        b = batch()
        lp, _ = policy_logprobs(policy, b, temperature=0.7, options=options)
        (lp * b.response_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in adapter_parameters(policy)}
        assert all(g is not None for g in grads.values())
        results[name] = (lp.detach() * b.response_mask, grads)
    ref_lp, ref_grads = results["padded"]
    assert any(g.abs().max() > 1e-4 for g in ref_grads.values())
    for name, (lp, grads) in results.items():
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5, msg=name)
        for n in ref_grads:
            err = float((grads[n] - ref_grads[n]).abs().max())
            assert err <= 1e-4 * float(ref_grads[n].abs().max()) + 1e-7, (
                name,
                n,
                err,
                float(ref_grads[n].abs().max()),
            )


def test_merged_state_is_the_plain_model_and_leaves_training_weights_alone(tiny_model_dir):
    plain, policy = lora_policy(tiny_model_dir)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged = dict(merged_state(policy))
    assert set(merged) == set(plain.state_dict())
    only = dict(merged_state(policy, only_adapted=True))
    assert only and set(only) < set(merged) and all(k.endswith(".weight") for k in only)
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    copy_ = copy.deepcopy(plain)
    copy_.load_state_dict(merged)
    torch.testing.assert_close(logprobs(copy_), logprobs(policy), rtol=0, atol=1e-5)


def test_adapter_tensors_carry_the_adapter(tiny_model_dir):
    from peft.utils import set_peft_model_state_dict

    _, policy = lora_policy(tiny_model_dir)
    names = [n for n, _ in adapter_state(policy)]
    assert names and all(n.startswith("base_model.model.") and ".default." not in n for n in names)
    _, other = lora_policy(tiny_model_dir, seed=9)
    set_peft_model_state_dict(other, dict(policy_weights(policy, mode="adapter")))
    torch.testing.assert_close(logprobs(other), logprobs(policy), rtol=0, atol=0)
    with pytest.raises(ValueError, match="'merged' or 'adapter'"):
        list(policy_weights(policy, mode="delta"))


def test_generation_shared_and_synced_engines_agree(tiny_model_dir):
    """The native engine sampling through the PeftModel (shared module) and a plain copy refreshed with the
    merged weights through sync_weights generate the same tokens."""
    plain, policy = lora_policy(tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    prompts = [tok.encode("What is 3 + 4?"), tok.encode("What is 10 + 2?")]
    params = SamplingParams(max_tokens=6, n=2, greedy=True)
    shared = NativeEngine(policy, [tok.eos_token_id], tok.pad_token_id).generate(prompts, params)
    engine = NativeEngine(plain, [tok.eos_token_id], tok.pad_token_id)
    before = engine.generate(prompts, params)
    engine.sync_weights(policy_weights(policy))
    after = engine.generate(prompts, params)
    assert after.response_ids == shared.response_ids
    assert before.response_ids != shared.response_ids  # the adapters change what is generated
    torch.testing.assert_close(torch.tensor(after.response_logprobs), torch.tensor(shared.response_logprobs))


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_export_loads_outside_posttrain(tiny_model_dir, tmp_path, merge):
    from peft import PeftModel

    _, policy = lora_policy(tiny_model_dir)
    out, how = export_policy(policy, load_tokenizer(tiny_model_dir), tmp_path / "out", merge=merge)
    assert (out / "tokenizer_config.json").is_file()
    if merge:
        assert "AutoModelForCausalLM" in how and not (out / "adapter_config.json").exists()
        loaded = AutoModelForCausalLM.from_pretrained(out)
    else:
        assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    ids = batch().input_ids
    policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, policy(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_adapter_path_starts_from_a_saved_adapter(tiny_model_dir, tmp_path):
    _, policy = lora_policy(tiny_model_dir)
    out, _ = export_policy(policy, None, tmp_path / "stage1")
    cfg = build_config(overrides=[f"model.lora_adapter_path={out}"])
    check_lora_config(cfg, read_model_config(str(tiny_model_dir)))
    resumed = apply_lora(load_causal_lm(tiny_model_dir), cfg)
    assert {n for n, p in resumed.named_parameters() if p.requires_grad} == {
        n for n, _ in adapter_parameters(resumed)
    }
    torch.testing.assert_close(logprobs(resumed), logprobs(policy), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"model.lora_rank=8 differs from the rank r=4.*model.lora_rank=4"):
        check_lora_config(build_config(overrides=[f"model.lora_adapter_path={out}", "model.lora_rank=8"]))
    with pytest.raises(ValueError, match=r"model.lora_alpha=32.0 \(adapter: 8.0\)"):
        check_lora_config(build_config(overrides=[f"model.lora_adapter_path={out}", "model.lora_alpha=32"]))


def test_checkpoint_holds_adapters_only_and_round_trips(tiny_model_dir, tmp_path):
    from posttrain.train.sharded_state import saved_shapes

    _, policy = lora_policy(tiny_model_dir)
    ckpt = save_checkpoint(tmp_path, 1, modules={"actor": policy})
    stored = {
        n.removeprefix("actor.model.") for n in saved_shapes(ckpt / "state") if n.startswith("actor.model.")
    }
    adapters = {n for n, _ in adapter_parameters(policy)}
    # Frozen base weights come back from model.path. DCP keeps the second name of a tied weight (the tiny
    # model's output head shares the embedding), so that one frozen tensor is stored too.
    assert adapters <= stored and stored - adapters <= {"base_model.model.lm_head.weight"}
    _, other = lora_policy(tiny_model_dir, seed=7)
    load_checkpoint(ckpt, modules={"actor": other}, restore_rng=False)
    torch.testing.assert_close(logprobs(other), logprobs(policy), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        rank8 = apply_lora(load_causal_lm(tiny_model_dir), lora_cfg("model.lora_rank=8"))
    with pytest.raises(ValueError, match="shape mismatch"):
        load_checkpoint(ckpt, modules={"actor": rank8}, restore_rng=False)


def test_memory_report_counts_adapters_and_the_shared_reference(tiny_model_dir):
    plain, policy = lora_policy(tiny_model_dir)
    m = lora_memory(policy, uses_reference=True)
    shape = ModelShape.from_path(tiny_model_dir)
    assert m.trainable_params == shape.lora_params(4) == sum(p.numel() for _, p in adapter_parameters(policy))
    assert (
        m.total_params - m.trainable_params
        == shape.num_params()
        == sum(p.numel() for p in plain.parameters())
    )
    assert (
        m.optimizer_bytes == 2 * 4 * m.trainable_params
        and m.full_optimizer_bytes == 2 * 4 * shape.num_params()
    )
    assert m.reference_shared_bytes == 4 * shape.num_params()
    assert lora_memory(policy, uses_reference=False).reference_shared_bytes == 0


CONFIG_ERRORS = [  # (overrides, regex the message must match: key, value, rule, alternative)
    (["trainer.export_merged=true"], r"trainer.export_merged=true .* LoRA is off .* model.lora_rank=32"),
    (
        ["model.lora_rank=32", "model.target_modules=[]"],
        r"model.target_modules=\[\] gives LoRA no layer.*all-linear",
    ),
    (
        ["model.lora_rank=32", "model.target_modules=[all-linear,q_proj]"],
        r"mixes 'all-linear' .*\(\['q_proj'\]\)",
    ),
    (["model.lora_rank=32", "model.target_modules=[q_proj,lm_head]"], r"\['lm_head'\].*all-linear"),
    (["model.lora_rank=32", "model.lora_alpha=0"], r"model.lora_alpha=0 must be > 0.*model.lora_alpha=32"),
    (["model.lora_rank=32", "model.lora_dropout=1"], r"model.lora_dropout=1 must be < 1.*0.05"),
    (
        ["model.lora_adapter_path=/nonexistent"],
        r"model.lora_adapter_path='/nonexistent' .*\(no adapter_config.json\)",
    ),
]


@pytest.mark.parametrize("overrides,match", CONFIG_ERRORS, ids=[str(i) for i in range(len(CONFIG_ERRORS))])
def test_config_errors_name_key_rule_and_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        check_lora_config(build_config(overrides=overrides))


def test_unknown_target_module_suggests_the_architectures_names(tiny_model_dir):
    cfg = build_config(overrides=["model.lora_rank=32", "model.target_modules=[q_prj,v_proj]"])
    with pytest.raises(ValueError, match=r"\['q_prj'\] match no linear layer.*did you mean \['q_proj'\]"):
        check_lora_config(cfg, read_model_config(str(tiny_model_dir)))
    check_lora_config(
        build_config(overrides=["model.lora_rank=32", "model.target_modules=[q_proj,v_proj]"]),
        read_model_config(str(tiny_model_dir)),
    )


def test_small_rank_warns_about_convergence(monkeypatch):
    from posttrain.utils import console

    monkeypatch.setattr(console, "_WARNED", set())
    with pytest.warns(UserWarning, match="model.lora_rank=8: ranks below 32"):
        check_lora_config(build_config(overrides=["model.lora_rank=8"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_lora_config(build_config(overrides=["model.lora_rank=32"]))


def test_lora_errors_come_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    from posttrain.rl import build as setup

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(setup, "load_causal_lm", no_load)
    cfg = build_config(
        overrides=[f"model.path={tiny_model_dir}", "model.lora_rank=32", "model.target_modules=foo"]
    )
    with pytest.raises(ValueError, match="model.target_modules"):
        setup.build_components(cfg, quiet=True)


def test_adapter_json_is_what_peft_wrote(tiny_model_dir, tmp_path):
    _, policy = lora_policy(tiny_model_dir, "model.target_modules=[q_proj,v_proj]", "model.lora_dropout=0.1")
    out, _ = export_policy(policy, None, tmp_path / "a")
    data = json.loads((out / "adapter_config.json").read_text())
    assert (
        data["r"] == 4 and data["lora_alpha"] == 8 and sorted(data["target_modules"]) == ["q_proj", "v_proj"]
    )
    assert data["lora_dropout"] == 0.1
