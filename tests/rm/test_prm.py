"""`posttrain rm` with rm.kind=prm: TRL-identical tokenization of stepwise rows, bad rows exit 2 naming file,
row and key, the export loads with plain transformers and reproduces the run's held-out step accuracy,
micro-batching leaves the gradient unchanged, the demo's chains are labelled right."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

from posttrain.cli import main
from posttrain.config.load import build_config
from posttrain.models.tiny import build_tiny_tokenizer
from posttrain.rm.command import run_rm_command
from posttrain.rm.prm import load_prm, prm_step
from posttrain.rm.prm_data import IGNORED, StepwiseRow, tokenize_steps
from posttrain.rm.prm_demo import arithmetic_chains, final_sum_reward, sft_rows, sum_problems, write_chains
from posttrain.train.trainable import Trainable
from posttrain.utils.metrics import read_metrics
from tests.helpers import GradCapture

# Recorded outputs of TRL's own PRMTrainer.tokenize_row on fixed rows (the file says which TRL commit): the
# trainer is not in the TRL release installed here, so its function is compared live only where importable.
TRL_CASES = json.loads((Path(__file__).parent / "data" / "trl_prm_tokenization.json").read_text())["cases"]


def _tokenizer(bos_token):
    tok = build_tiny_tokenizer()
    if bos_token:
        tok.bos_token = bos_token
    return tok


def _row(case) -> StepwiseRow:
    r = case["row"]
    return StepwiseRow(r["prompt"], r["completions"], r["labels"], "case")


@pytest.mark.parametrize("case", TRL_CASES, ids=lambda c: f"bos={c['bos_token']}-sep={c['step_separator']!r}")
def test_tokenization_matches_trl_recorded(case):
    ours = tokenize_steps(_row(case), _tokenizer(case["bos_token"]), case["step_separator"])
    assert ours.input_ids == case["trl"]["input_ids"]
    assert ours.labels == case["trl"]["labels"]
    assert [x for x in ours.labels if x != IGNORED] == [int(b) for b in case["row"]["labels"]]


def test_tokenization_matches_trl_live():
    prm = pytest.importorskip("trl.experimental.prm", reason="this TRL release has no PRM trainer")
    for case in TRL_CASES:
        tok = _tokenizer(case["bos_token"])
        theirs = prm.PRMTrainer.tokenize_row(
            case["row"], tok, case["step_separator"], None, None, False, False
        )
        ours = tokenize_steps(_row(case), tok, case["step_separator"])
        assert (ours.input_ids, ours.labels) == (theirs["input_ids"], theirs["labels"])


GOOD = {"prompt": "Add 1, 2.\n", "completions": ["1+2=3"], "labels": [True]}


@pytest.mark.parametrize(
    "bad, key, rule",
    [
        ({**GOOD, "labels": [True, False]}, "'labels'", "one label per step"),
        ({**GOOD, "completions": [], "labels": []}, "'completions'", "non-empty list"),
        (
            {**GOOD, "completions": ["1+2=3", " "], "labels": [True, True]},
            "'completions'[1]",
            "non-empty string",
        ),
        ({**GOOD, "labels": [1]}, "'labels'[0]", "booleans"),
        ({"prompt": "p", "labels": [True]}, "'completions'", "missing key"),
    ],
    ids=["lengths-differ", "no-steps", "empty-step", "label-not-bool", "missing-key"],
)
def test_bad_stepwise_rows_exit_2_naming_file_row_and_key(tmp_path, bad, key, rule, capsys):
    data = tmp_path / "steps.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n")
    code = main(
        [
            "rm",
            "rm.kind=prm",
            "model.path=builtin:missing",
            f"data.train_files=[{data}]",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )  # the rows are checked before the model path
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(data) in err and "row 1" in err and key in err and rule in err and "Traceback" not in err


def test_explain_rm_checks_the_rows_and_says_it_has_no_plan_for_prm(tmp_path, capsys):
    data = tmp_path / "steps.jsonl"
    data.write_text(json.dumps(GOOD) + "\n")
    code = main(
        [
            "explain",
            "rm",
            "rm.kind=prm",
            "model.path=builtin:base",
            f"data.train_files=[{data}]",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "rm.kind=prm has no plan yet" in err and "Traceback" not in err


def prm_args(model_dir, data_dir, run_dir, *extra):
    return [
        "rm.kind=prm",
        f"model.path={model_dir}",
        f"data.train_files=[{data_dir / 'train.jsonl'}]",
        f"data.val_files=[{data_dir / 'val.jsonl'}]",
        f"trainer.run_dir={run_dir}",
        "rm.batch_size=8",
        "rm.micro_batch_size_per_gpu=4",
        "rm.max_steps=4",
        "rm.optim.lr=1e-3",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.loggers=[jsonl]",
        *extra,
    ]


def test_export_loads_with_plain_transformers_and_reproduces_the_step_scores(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    write_chains(data, n_train=32, n_val=12, seed=5)
    run_dir = tmp_path / "run"
    out = run_rm_command(
        build_config(overrides=prm_args(tiny_model_dir, data, run_dir, "rm.step_separator=|")), quiet=True
    )
    model = AutoModelForTokenClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.num_labels == 2 and model.config.step_separator == "|"
    right = total = 0
    for line in (data / "val.jsonl").read_text().splitlines():  # plain transformers, TRL's layout by hand
        row = json.loads(line)
        ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + tok(
            row["prompt"], add_special_tokens=False
        )["input_ids"]
        ends = []
        for step in row["completions"]:
            ids += (
                tok(step, add_special_tokens=False)["input_ids"]
                + tok("|", add_special_tokens=False)["input_ids"]
            )
            ends.append(len(ids) - 1)
        with torch.no_grad():
            probs = model(input_ids=torch.tensor([ids])).logits.softmax(-1)[0, :, 1]
        right += sum((float(probs[e]) > 0.5) == label for e, label in zip(ends, row["labels"]))
        total += len(ends)
    assert right / total == pytest.approx(model.config.val_step_accuracy)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics if "prm/step_accuracy" in m] == [1, 2, 3, 4]
    assert [m["step"] for m in metrics if "val/step_accuracy" in m] == [0, 2, 4]


def test_micro_batches_leave_the_gradient_unchanged(tiny_model_dir):
    tok = build_tiny_tokenizer()
    rows = [
        tokenize_steps(StepwiseRow(r["prompt"], r["completions"], r["labels"], "r"), tok, "\n")
        for r in arithmetic_chains(6, seed=2, terms=3)
    ]
    grads = []
    for micro in (6, 1, 4):
        torch.manual_seed(0)
        model = load_prm(tiny_model_dir, tok.pad_token_id)
        model.score.reset_parameters()  # the same new head each time
        cfg = build_config(overrides=["rm.optim.grad_clip=0"]).rm.optim
        trainable = Trainable.create(model, cfg, 1)
        capture = GradCapture(p for p in model.parameters() if p.requires_grad)
        capture.param_groups[0]["lr"] = 0.0  # read for the step's metrics
        trainable.optimizer = capture
        prm_step(trainable, rows, tok.pad_token_id, micro)
        grads.append(capture.grads)
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_demo_chains_label_the_first_wrong_step_and_every_later_one():
    for row in arithmetic_chains(200, seed=9):
        ok = True
        for step, label in zip(row["completions"], row["labels"]):
            left, result = step.split("=")
            a, b = map(int, left.split("+"))
            ok = ok and a + b == int(result)
            assert label == ok
        numbers = [int(x) for x in row["prompt"].removeprefix("Add ").rstrip(".\n").split(", ")]
        assert row["labels"][-1] == (int(row["completions"][-1].split("=")[1]) == sum(numbers))


def test_demo_chains_that_stop_end_at_their_wrong_step_and_label_each_steps_own_sum():
    rows = arithmetic_chains(300, seed=4, after_error="stop")
    for row in rows:
        sums_right = [
            sum(map(int, step.split("=")[0].split("+"))) == int(step.split("=")[1])
            for step in row["completions"]
        ]
        assert row["labels"] == sums_right
        assert all(row["labels"][:-1])  # a false label only on the last step
    assert 0.3 < sum(not r["labels"][-1] for r in rows) / len(rows) < 0.7  # p_error 0.5


def test_demo_held_out_prompts_are_in_no_training_sft_or_grpo_row(tmp_path):
    train, val = write_chains(tmp_path, n_train=2000, n_val=200, seed=3, terms=3, max_operand=9)
    prompts = {
        name: {json.loads(line)["prompt"] for line in path.open()}
        for name, path in (("t", train), ("v", val))
    }
    sft = {r["prompt"] for r in sft_rows(2000, 5, terms=3, max_operand=9)}
    grpo_train = {r["prompt"] for r in sum_problems(2000, 6, False, terms=3, max_operand=9)}
    grpo_val = {r["prompt"] for r in sum_problems(200, 7, True, terms=3, max_operand=9)}
    assert len(prompts["v"]) > 20 and len(prompts["t"]) > 400  # 729 lists of 3 numbers, 10% held out
    assert not prompts["v"] & (prompts["t"] | sft | grpo_train)
    assert not grpo_val & (prompts["t"] | sft | grpo_train)


def test_demo_outcome_reward_reads_the_last_steps_sum():
    row = sum_problems(1, 0, False, terms=4)[0]
    chain = arithmetic_chains(1, 0, terms=4, p_error=0.0, held_out=False)[0]
    assert row["prompt"] == chain["prompt"]
    response = "\n".join(chain["completions"]) + "\n"
    assert final_sum_reward(row["prompt"], response, row["answer"], {}) == 1.0
    assert final_sum_reward(row["prompt"], response + "1+1=3", row["answer"], {}) == 0.0
    assert final_sum_reward(row["prompt"], "", row["answer"], {}) == 0.0


@pytest.mark.parametrize("percent", [0, 100])
def test_demo_held_out_split_needs_prompts_on_both_sides(percent):
    with pytest.raises(ValueError, match=f"held_out_percent={percent}: both splits need prompts; use 1-99"):
        arithmetic_chains(2, 1, held_out=percent == 0, held_out_percent=percent)
