"""`posttrain sft` on several data-parallel ranks (torchrun, gloo on loopback, the model sharded with FSDP2)
trains the one-rank run: the same losses, validation metrics (held-out loss and greedy accuracy) and exported
weights, on 2 ranks of one node and on two nodes of one rank each (tests/parallel/nodes.py); its checkpoint
resumes on one rank; a batch that does not split over the ranks is refused before any model loads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.utils.metrics import read_metrics
from tests.parallel.conftest import (
    REPO,
    end_group,
    loopback_env,
    loopback_rendezvous,
    start_group,
    torchrun_command,
)
from tests.parallel.nodes import run_on_nodes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]  # a hung job fails the test, its processes killed


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """12 prompt/response rows to train on, 3 held out (the ranks each validate all of them)."""
    d = tmp_path_factory.mktemp("sft-data")
    rows = [{"prompt": f"What is {i} + 1?", "response": str(i + 1)} for i in range(15)]
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:12]))
    (d / "val.jsonl").write_text("\n".join(json.dumps(r) for r in rows[12:]))
    return d


def _args(model_dir, data: Path, run_dir: Path, *extra: str) -> list[str]:
    """3 steps of 4 examples (each of 2 ranks trains 2, in micro-batches of 1), validated and checkpointed at
    every step; exact_match scores the greedy responses (val/accuracy: generation on the sharded model)."""
    return [
        f"model.path={model_dir}",
        f"sft.train_files=[{data / 'train.jsonl'}]",
        f"sft.val_files=[{data / 'val.jsonl'}]",
        f"trainer.run_dir={run_dir}",
        "trainer.loggers=[jsonl]",
        "trainer.device=cpu",
        "reward.function=exact_match",
        "data.max_response_length=4",
        "sft.batch_size=4",
        "sft.micro_batch_size_per_gpu=1",
        "sft.max_steps=3",
        "sft.optim.lr=3e-3",
        "trainer.test_freq=1",
        "trainer.save_freq=1",
        *extra,
    ]


def _one_process(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "sft", *args],
        env=loopback_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def _torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N -m posttrain sft ...`, as a user runs it on CPU."""
    with loopback_rendezvous() as port:
        cmd = torchrun_command(nproc, port, "-m", "posttrain", "sft", *args)
        proc = start_group(
            cmd, env=loopback_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            end_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _same_weights(a: Path, b: Path) -> None:
    """The data-parallel tests' tolerance (tests/rm/test_rm_ranks.py)."""
    wa = load_file(str(a / "sft_model" / "model.safetensors"))
    wb = load_file(str(b / "sft_model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=2e-6, rtol=1e-5)


def _same_metrics(a: Path, b: Path) -> None:
    ma, mb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == [0, 1, 2, 3]  # validation at every step
    for x, y in zip(ma, mb):
        for key in ("sft/loss", "sft/grad_norm", "sft/token_nll", "val/loss", "val/accuracy"):
            if key in x or key in y:
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
    assert "sft/loss" in ma[-1] and "val/accuracy" in ma[-1]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_model_dir, data_dir) -> Path:
    """The reference: the same run as one plain process."""
    run = tmp_path_factory.mktemp("one") / "run"
    _one_process(_args(tiny_model_dir, data_dir, run))
    return run


@pytest.mark.slow  # about 3 minutes with the reference run on 2 loaded cores
def test_two_ranks_train_like_one_and_resume_on_one(tmp_path, tiny_model_dir, data_dir, one_rank):
    two = tmp_path / "two"
    done = _torchrun(2, _args(tiny_model_dir, data_dir, two))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.count("SFT done: 3 optimizer steps on 2 ranks") == 1  # rank 0 alone speaks
    _same_metrics(one_rank, two)
    _same_weights(one_rank, two)
    samples = [json.loads(line) for line in (two / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 3  # 4 validations of 3 prompts, written once (rank 0)
    # The 2-rank checkpoint of step 2 resumes on one rank to the uninterrupted weights.
    resumed = tmp_path / "resumed"
    _one_process(
        _args(tiny_model_dir, data_dir, resumed, f"trainer.resume={two / 'checkpoints' / 'step_000002'}")
    )
    _same_weights(one_rank, resumed)
    assert [m["step"] for m in read_metrics(resumed / "metrics.jsonl")] == [3]


@pytest.mark.slow
def test_two_nodes_train_like_one_process(tmp_path, tiny_model_dir, data_dir, one_rank):
    """Two launchers (`torchrun --nnodes 2 --node_rank N --nproc_per_node 1`) meeting on loopback."""
    two = tmp_path / "two"
    run_on_nodes(
        ["-m", "posttrain", "sft", *_args(tiny_model_dir, data_dir, two)], tmp_path / "out", nnodes=2
    )
    _same_metrics(one_rank, two)
    _same_weights(one_rank, two)


@pytest.mark.slow  # torchrun and two ranks' imports: over a main-suite test's budget
def test_a_batch_that_does_not_split_over_the_ranks_is_refused_before_any_model_loads(
    tmp_path, tiny_model_dir, data_dir
):
    done = _torchrun(2, _args(tiny_model_dir, data_dir, tmp_path / "run", "sft.batch_size=3"))
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "sft.batch_size (3) must split evenly over 2 data-parallel ranks" in said
    assert "Nearest valid: sft.batch_size=" in said
    assert "]: Traceback" not in said  # the ranks' CLI answered (exit 2); torchrun's own report follows
    assert not (tmp_path / "run" / "run_info.yaml").exists()
