"""`posttrain explain rm ...`: the plan of a reward-model run (pairs, steps, micro-batches, memory), and its data
checks, before any weights load."""

import json

from posttrain.cli import main
from posttrain.config.load import build_config
from posttrain.models.hf import load_tokenizer
from posttrain.models.model_path import builtin_base_dir
from posttrain.planning.rm_plan import batch_plan
from posttrain.rm.data import load_pairs, tokenize_pairs
from posttrain.rm.demo import write_arithmetic_pairs


def _args(data_dir, *extra):
    return [
        "explain",
        "rm",
        "model.path=builtin:base",
        f"data.train_files=[{data_dir / 'train.jsonl'}]",
        f"data.val_files=[{data_dir / 'val.jsonl'}]",
        *extra,
    ]


def test_plan_counts_pairs_steps_and_micro_batches(tmp_path, capsys):
    write_arithmetic_pairs(tmp_path, 50, 10, seed=1)
    extra = ["rm.batch_size=16", "rm.micro_batch_size_per_gpu=4", "rm.epochs=3", "--json"]
    assert main(_args(tmp_path, *extra)) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["train_pairs"]["read"] == plan["train_pairs"]["kept"] == 50
    assert plan["val_pairs"]["kept"] == 10
    assert plan["batch"] == {
        "pairs_per_step": 16,
        "ranks": 1,
        "pairs_per_rank": 16,
        "pairs_per_micro": 4,
        "token_budget": 0,
        "accumulation_steps": 4,
        "steps_per_epoch": 3,
        "pairs_left_out_per_epoch": 2,
        "total_steps": 9,
    }
    memory = plan["memory"]
    # fp32 AdamW: two moments per trained parameter; the scalar head replaces the LM head
    assert memory["optimizer"] == 2 * memory["gradients"] == 2 * memory["weights"]
    assert memory["micro_batch_tokens"] == 2 * 4 * plan["train_pairs"]["longest_tokens"]
    assert memory["peak"] >= memory["weights"] + memory["optimizer"] + memory["activations"] // 2


def test_text_plan_names_the_keys(tmp_path, capsys):
    write_arithmetic_pairs(tmp_path, 40, 8, seed=1)
    assert main(_args(tmp_path, "rm.batch_size=8", "rm.max_steps=3")) == 0
    out = capsys.readouterr().out
    assert "rm.batch_size=8 pairs = 16 sequences" in out
    assert "capped by rm.max_steps=3 = 3 optimizer steps" in out
    assert "memory estimate (builtin:base" in out


def test_bad_rows_and_too_few_pairs_exit_2(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text('{"prompt": "p", "rejected": "no"}\n')
    (tmp_path / "val.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    assert main(_args(tmp_path)) == 2
    assert "missing key 'chosen'" in capsys.readouterr().err
    write_arithmetic_pairs(tmp_path, 10, 2, seed=1)
    assert main(_args(tmp_path, "rm.batch_size=32")) == 2
    assert "rm.batch_size=32 exceeds the 10 usable training pairs" in capsys.readouterr().err


def test_micro_batch_larger_than_the_step_is_one_pass():
    cfg = build_config(overrides=["rm.batch_size=4", "rm.micro_batch_size_per_gpu=8", "rm.max_steps=0"])
    plan = batch_plan(cfg, 10)
    assert (plan.pairs_per_micro, plan.accumulation_steps, plan.steps_per_epoch) == (4, 1, 2)


def test_builtin_tiny_passes_the_command_line_checks(tmp_path, capsys):
    """builtin:tiny beside pair files is the demonstration's start, not the user's task: the command line's
    model check (the one `posttrain rm` runs too) lets it through."""
    write_arithmetic_pairs(tmp_path, 40, 8, seed=1)
    argv = _args(tmp_path, "rm.batch_size=8", "--json")
    argv[2] = "model.path=builtin:tiny"
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["batch"]["steps_per_epoch"] == 5


def test_dynamic_batch_plan_and_a_budget_too_small(tmp_path, capsys):
    write_arithmetic_pairs(tmp_path, 40, 8, seed=1)
    dynamic = ["rm.batch_size=8", "rm.use_dynamic_bsz=true", "rm.max_token_len_per_gpu=200"]
    assert main(_args(tmp_path, *dynamic, "--json")) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["batch"]["token_budget"] == 200 and plan["batch"]["pairs_per_micro"] == 0
    assert plan["memory"]["micro_batch_tokens"] == 200
    assert main(_args(tmp_path, *dynamic)) == 0
    assert "micro-batches by token budget: whole pairs, <= 200 tokens" in capsys.readouterr().out
    assert (
        main(_args(tmp_path, "rm.batch_size=8", "rm.use_dynamic_bsz=true", "rm.max_token_len_per_gpu=10"))
        == 2
    )
    assert "rm.max_token_len_per_gpu=10 is smaller than the longest training pair" in capsys.readouterr().err


def test_plan_on_two_ranks_shows_each_ranks_share_and_micro_batches(tmp_path, capsys):
    """--world-size 2: each rank trains half of a step's pairs in its own micro-batches; model states are
    sharded over the ranks; a batch that does not split is refused (exit 2) with the nearest valid sizes."""
    write_arithmetic_pairs(tmp_path, 50, 10, seed=1)
    extra = ["rm.batch_size=16", "rm.micro_batch_size_per_gpu=4", "--json"]
    assert main(_args(tmp_path, *extra)) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(_args(tmp_path, *extra, "--world-size", "2")) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["batch"]["ranks"] == 2 and two["batch"]["pairs_per_rank"] == 8
    assert two["batch"]["pairs_per_micro"] == 4 and two["batch"]["accumulation_steps"] == 2
    assert two["batch"]["total_steps"] == one["batch"]["total_steps"]
    for key in ("weights", "gradients", "optimizer"):
        assert two["memory"][key] == one["memory"][key] // 2
    assert two["memory"]["activations"] == one["memory"]["activations"]  # a micro-batch is the same size
    assert (
        main(_args(tmp_path, "rm.batch_size=16", "rm.micro_batch_size_per_gpu=4", "--world-size", "2")) == 0
    )
    out = capsys.readouterr().out
    assert "(2 data-parallel ranks;" in out
    assert "each trains 8 pairs = 16 sequences of every step (rm.batch_size / 2)" in out
    assert "2 gradient-accumulation step(s) on each rank" in out
    assert main(_args(tmp_path, "rm.batch_size=15", "--world-size", "2")) == 2
    assert "rm.batch_size=14 or 16" in capsys.readouterr().err


def test_packed_estimate_counts_the_packed_tokens_of_the_longest_pairs(tmp_path, capsys):
    """model.use_remove_padding: the activations are counted for the texts of the rm.micro_batch_size_per_gpu
    longest pairs packed into rows (here one row: their real tokens), not for every text padded to the longest."""
    rows = [
        {
            "prompt": f"What is {i} + 3?",
            "chosen": f"{i + 3}, because {i} plus three is {i + 3}.",
            "rejected": "7",
        }
        for i in range(12)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "val.jsonl").write_text(json.dumps(rows[0]) + "\n")
    extra = ["rm.batch_size=4", "rm.micro_batch_size_per_gpu=2", "--json"]
    assert main(_args(tmp_path, *extra)) == 0
    padded = json.loads(capsys.readouterr().out)["memory"]
    assert main(_args(tmp_path, "model.use_remove_padding=true", *extra)) == 0
    packed = json.loads(capsys.readouterr().out)["memory"]
    cfg = build_config(overrides=["model.path=builtin:base"])
    tokenizer = load_tokenizer(builtin_base_dir(cfg))
    pairs, _ = tokenize_pairs(load_pairs(cfg, [str(tmp_path / "train.jsonl")]), tokenizer, 512)
    sizes = sorted((len(p.chosen_ids) + len(p.rejected_ids) for p in pairs), reverse=True)
    assert packed["micro_batch_tokens"] == sizes[0] + sizes[1]  # 4 texts of < 40 tokens: one row of 512
    assert packed["micro_batch_tokens"] < padded["micro_batch_tokens"]
    assert packed["activations"] < padded["activations"]
