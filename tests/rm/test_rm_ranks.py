"""`posttrain rm` on 2 data-parallel ranks (torchrun, gloo on loopback, the model sharded with FSDP2) trains the
one-rank run: the same losses, validation metrics and exported weights; its checkpoint resumes on one rank; a
batch that does not split over the ranks is refused before any model loads."""

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from posttrain.batching.epochs import EpochSchedule
from posttrain.cli import main
from posttrain.rm.demo import write_arithmetic_pairs
from posttrain.utils.metrics import read_metrics
from tests.parallel.conftest import (
    REPO,
    end_group,
    loopback_env,
    loopback_rendezvous,
    start_group,
    torchrun_command,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]  # a hung job fails the test, its processes killed


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    write_arithmetic_pairs(d, n_train=16, n_val=7, seed=3)  # 7 held-out pairs: the ranks score 3 and 4
    return d


def _args(model_dir, data_dir, run_dir, *extra) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.train_files=[{data_dir / 'train.jsonl'}]",
        f"data.val_files=[{data_dir / 'val.jsonl'}]",
        f"trainer.run_dir={run_dir}",
        "trainer.loggers=[jsonl]",
        "rm.batch_size=4",
        "rm.micro_batch_size_per_gpu=1",
        "rm.max_steps=2",
        "rm.optim.lr=1e-3",
        "trainer.test_freq=1",
        "trainer.save_freq=1",
        *extra,
    ]


def _launch(nproc: int, args: list[str]) -> None:
    """`torchrun --nproc_per_node N -m posttrain rm ...`, as a user runs it on CPU."""
    with loopback_rendezvous() as port:
        cmd = torchrun_command(nproc, port, "-m", "posttrain", "rm", *args)
        proc = start_group(
            cmd, env=loopback_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            end_group(proc)
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-6000:]}"


def _same_weights(a_dir, b_dir) -> None:
    a = load_file(str(a_dir / "reward_model" / "model.safetensors"))
    b = load_file(str(b_dir / "reward_model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-6, rtol=1e-5)


def _same_metrics(a_dir, b_dir) -> None:
    a, b = read_metrics(a_dir / "metrics.jsonl"), read_metrics(b_dir / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]  # validation at every step
    for ra, rb in zip(a, b):
        for key in (
            "rm/loss",
            "rm/accuracy",
            "rm/margin",
            "rm/grad_norm",
            *[k for k in ra if k.startswith("val/")],
        ):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (ra["step"], key)


def test_two_ranks_train_like_one_and_resume_on_one(tmp_path, tiny_model_dir, data_dir):
    """Micro-batches of one pair: each rank computes exactly the one-rank micro-batches, so only the order of
    the gradient sum differs (the ranks' shares are reduced by FSDP2)."""
    one, two, moved = tmp_path / "one", tmp_path / "two", tmp_path / "moved"
    _launch(1, _args(tiny_model_dir, data_dir, one))
    _launch(2, _args(tiny_model_dir, data_dir, two))
    _same_metrics(one, two)
    _same_weights(one, two)
    # The 2-rank checkpoint of step 1 resumes on one rank and ends where the uninterrupted run ended.
    step_1 = two / "checkpoints" / "step_000001"
    _launch(1, _args(tiny_model_dir, data_dir, moved, f"trainer.resume={step_1}"))
    _same_weights(one, moved)


def _uneven_pairs(data_dir, out_dir):
    """8 training pairs whose 2 steps of 4 give rank 0 two long pairs (one micro-batch each under a budget of
    140 tokens) and rank 1 two short ones (one micro-batch together): the ranks make 2 and 1 micro-batches."""
    order = [
        i
        for step in (1, 2)
        for i in EpochSchedule(num_items=8, batch_size=4, epochs=1, seed=1, max_steps=2).indices(step)
    ]  # trainer.seed=1
    long_rows = {i for k, i in enumerate(order) if k % 4 < 2}  # the first half of each step: rank 0's share
    rows = []
    for i in range(8):
        prompt = f"What is {i} + 3?" + (" Explain each step of the sum." * 3 if i in long_rows else "")
        rows.append({"prompt": prompt, "chosen": f"The sum is {i + 3}.", "rejected": f"The sum is {i + 4}."})
    out_dir.mkdir()
    (out_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out_dir / "val.jsonl").write_text((data_dir / "val.jsonl").read_text())
    return out_dir


def test_two_ranks_with_uneven_micro_batches_packing_and_lora_train_like_one(
    tmp_path, tiny_model_dir, data_dir
):
    """rm.use_dynamic_bsz, model.use_remove_padding and LoRA on 2 ranks. The token budget cuts rank 0's share
    into 2 micro-batches and rank 1's into 1 (rank 1 adds a call without gradient so FSDP2's collectives line
    up); one rank cuts the step into the same 3 micro-batches, so the sums match to rounding. The adapters
    and the head (inside PEFT's wrapper, a unit of its own under FSDP2) train; the merged exports match."""
    pairs = _uneven_pairs(data_dir, tmp_path / "pairs")
    extra = [
        "rm.use_dynamic_bsz=true",
        "rm.max_token_len_per_gpu=140",
        "model.use_remove_padding=true",
        "model.lora_rank=4",
        "model.lora_alpha=8",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    _launch(1, _args(tiny_model_dir, pairs, one, *extra))
    _launch(2, _args(tiny_model_dir, pairs, two, *extra))
    _same_metrics(one, two)
    _same_weights(one, two)
    steps = [r for r in read_metrics(one / "metrics.jsonl") if "rm/loss" in r]
    assert [r["rm/micro_batches"] for r in steps] == [3, 3]  # long, long, short + short
    steps = [r for r in read_metrics(two / "metrics.jsonl") if "rm/loss" in r]
    assert [r["rm/micro_batches"] for r in steps] == [2, 2]  # the most any rank makes


def test_batch_that_does_not_split_over_the_ranks_is_refused_first(
    tmp_path, tiny_model_dir, data_dir, capsys, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets; refused before any process group or model
    run_dir = tmp_path / "run"
    args = [a for a in _args(tiny_model_dir, data_dir, run_dir) if not a.startswith("rm.batch_size=")]
    assert main(["rm", *args, "rm.batch_size=5"]) == 2
    err = capsys.readouterr().err
    assert "rm.batch_size=5 must split evenly over the 2 data-parallel ranks" in err
    assert "rm.batch_size=4 or 6" in err
    assert not run_dir.exists()
