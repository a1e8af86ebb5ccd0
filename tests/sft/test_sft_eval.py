"""`posttrain sft` (loss on response tokens only) and `posttrain eval` on directories and checkpoints."""

import pytest
import torch

from posttrain.config.plan import build_sft_plan
from posttrain.data.batch import build_rollout_batch
from posttrain.forward.passes import policy_logprobs
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.rl.eval_command import run_eval_command
from posttrain.rl.train_command import run_training
from posttrain.sft.command import run_sft_command
from posttrain.sft.loop import make_examples
from tests.helpers import sft_config, small_config


def test_sft_lowers_response_loss_and_saves(tiny_model_dir, tmp_path):
    cfg = sft_config(tiny_model_dir, tmp_path)
    tok = load_tokenizer(tiny_model_dir)
    from posttrain.data.datasets import load_records

    records = load_records(cfg.sft.train_files[0], "prompt", "response")
    examples = make_examples(records, tok, 64, 8)
    assert all(e.response_ids[-1] == tok.eos_token_id for e in examples)
    batch = build_rollout_batch(
        [e.prompt_ids for e in examples],
        [e.response_ids for e in examples],
        list(range(len(examples))),
        tok.pad_token_id,
    )

    def nll(model):
        with torch.no_grad():
            lp, _ = policy_logprobs(model, batch)
        return float(-(lp * batch.response_mask).sum() / batch.response_mask.sum())

    before = nll(load_causal_lm(tiny_model_dir))
    out = run_sft_command(cfg)
    after = nll(load_causal_lm(out))
    assert after < before - 0.5, (before, after)


def test_sft_loss_ignores_prompt_tokens(tiny_model_dir):
    """Changing the prompt's target tokens cannot change the SFT loss: only response tokens count."""
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir)
    a = build_rollout_batch([[5, 6, 7, 8]], [[9, 10, 2]], [0], tok.pad_token_id)
    lp_a, _ = policy_logprobs(model, a)
    assert lp_a.shape == (1, 3)
    full = model(input_ids=a.input_ids, use_cache=False).logits.log_softmax(-1)
    expected = full[0, 3:6].gather(-1, torch.tensor([[9], [10], [2]])).flatten()
    torch.testing.assert_close(lp_a[0], expected, rtol=1e-5, atol=1e-5)


def test_sft_plan_errors_name_keys(tiny_model_dir, tmp_path):
    cfg = sft_config(tiny_model_dir, tmp_path, "sft.micro_batch_size_per_gpu=3")
    with pytest.raises(ValueError, match="sft.micro_batch_size_per_gpu"):
        build_sft_plan(cfg)


def test_eval_on_model_dir_and_checkpoint(tiny_model_dir, tmp_path, capsys):
    cfg = small_config(tiny_model_dir, tmp_path / "run", "trainer.total_steps=1")
    run_training(cfg, quiet=True)
    on_dir = run_eval_command(cfg, model_path=str(tmp_path / "run" / "final_model"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    on_ckpt = run_eval_command(cfg, model_path=str(ckpt))
    assert on_dir["val/accuracy"] == on_ckpt["val/accuracy"]
    assert on_dir["val/response_length_mean"] == on_ckpt["val/response_length_mean"]
    assert "val/accuracy" in capsys.readouterr().out
    with pytest.raises(ValueError, match="does not exist"):
        run_eval_command(cfg, model_path=str(tmp_path / "missing"))
