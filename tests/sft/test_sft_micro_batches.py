"""SFT takes its optimizer steps through the RL update's mini-batch step, so how a step's examples are cut into
micro-batches changes neither its loss nor the weights it leaves."""

import pytest
import torch

from posttrain.data.datasets import load_records
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.sft.loop import run_sft
from tests.helpers import sft_config


def test_sft_steps_do_not_depend_on_the_micro_batch_size(tiny_model_dir, tmp_path):
    runs = {}
    for micro in (1, 2, 8):  # 8 examples a step: single rows, pairs, or one micro-batch
        (tmp_path / str(micro)).mkdir()
        cfg = sft_config(
            tiny_model_dir, tmp_path / str(micro), "sft.max_steps=2", f"sft.micro_batch_size_per_gpu={micro}"
        )
        records = load_records(cfg.sft.train_files[0], "prompt", "response")
        torch.manual_seed(0)
        model = load_causal_lm(tiny_model_dir)
        history = run_sft(cfg, model, load_tokenizer(tiny_model_dir), records, quiet=True)
        runs[micro] = history, {k: v.detach().clone() for k, v in model.state_dict().items()}
    history, weights = runs[8]
    assert len(history) == 2
    for micro in (1, 2):
        other, other_weights = runs[micro]
        for a, b in zip(history, other):
            for key in ("sft/loss", "sft/grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-4), (micro, key)
        worst = max(  # Adam moves each weight about lr (3e-3) a step
            float((other_weights[k] - v).abs().max()) for k, v in weights.items()
        )
        assert worst < 1e-4, (micro, worst)
