"""Two nodes on this machine (tests/parallel/nodes.py: two `torchrun --nnodes 2 --node_rank N` launcher trees,
a c10d rendezvous on loopback): the job's sockets all listen on loopback, HSDP's mesh shards within a node and
replicates across nodes, `posttrain train` and `posttrain rm` train as one process does, checkpoints move
between one and two nodes, and a node that dies or never comes ends the job with a clear message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.utils.metrics import read_metrics
from tests.parallel.conftest import REPO, WORKERS, free_port, loopback_env
from tests.parallel.nodes import children, nodes, run_on_nodes, wait_all
from tests.sockets import is_loopback, listening_addresses

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.timeout(900),  # a hung job fails the test, its processes killed
]


def _wait_for(files: list[Path], started, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        for node in started:
            assert node.proc.poll() is None, node.output()[-3000:]
        assert time.monotonic() < deadline, [node.output()[-2000:] for node in started]
        time.sleep(0.2)


def test_two_nodes_of_two_ranks_shard_within_a_node_replicate_across_and_listen_on_loopback(tmp_path):
    """2 nodes x 2 ranks, fsdp_size=2: read from the mesh itself, each shard group is one node's ranks and each
    replicate group one rank of each node; every socket of both launchers and their ranks is on loopback."""
    out = tmp_path / "out"
    target = [str(WORKERS), "mesh", str(out), "fsdp_size=2"]
    with nodes(target, out, nproc=2) as started:
        _wait_for([out / f"mesh_{r}.json" for r in range(4)], started, timeout=300)
        said = [json.loads((out / f"mesh_{r}.json").read_text()) for r in range(4)]
        launchers = [node.proc.pid for node in started]
        first_node_ranks = children(launchers[0])
        listening = listening_addresses(launchers + [s["pid"] for s in said])
        (out / "release").touch()
        assert wait_all(started, 60) == [0, 0]
    assert [listening[pid] for pid in launchers] == [[], []]  # the launchers serve nothing
    nodes_of = said[0]["nodes"]
    assert nodes_of == [0, 0, 1, 1]  # torchrun numbers ranks node by node
    assert sorted(first_node_ranks) == sorted([said[0]["pid"], said[1]["pid"]])  # the first launcher's node
    for rank, s in enumerate(said):
        assert s["node"] == nodes_of[rank]
        assert [nodes_of[r] for r in s["groups"]["shard"]] == [s["node"]] * 2, s  # within this rank's node
        assert sorted(nodes_of[r] for r in s["groups"]["replicate"]) == [0, 1], s  # one rank per node
        assert rank in s["groups"]["shard"] and rank in s["groups"]["replicate"]
    addresses = [a for found in listening.values() for a in found]
    assert len(addresses) >= 5, listening  # rank 0's store and each rank's gloo: they were read
    assert all(is_loopback(a) for a in addresses), listening


# --- posttrain train ------------------------------------------------------------------------------------------


def _train_options(model_dir, run_dir: Path, **extra) -> list[str]:
    base = {
        "model.path": str(model_dir),
        "trainer.device": "cpu",
        "data.train_batch_size": 4,
        "rollout.n": 4,
        "actor.ppo_mini_batch_size": 2,
        "actor.ppo_micro_batch_size_per_gpu": 2,
        "actor.log_prob_micro_batch_size_per_gpu": 4,
        "data.num_train_examples": 16,
        "data.num_val_examples": 8,
        "data.max_response_length": 6,
        "trainer.total_steps": 3,
        "trainer.test_freq": 3,
        "trainer.save_freq": 1,
        "trainer.run_dir": str(run_dir),
        "trainer.loggers": "[jsonl]",
        "trainer.export_hf": "true",
        "actor.optim.lr": 1e-3,
        "actor.entropy_coeff": 0.1,  # the weights move even when every reward is 0 (a random tiny model)
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _train(args: list[str], out: Path, nnodes: int = 0, nproc: int = 1) -> None:
    """`posttrain train` as one plain process (nnodes 0) or on ``nnodes`` nodes of ``nproc`` ranks."""
    target = ["-m", "posttrain", "train", *args]
    if nnodes:
        run_on_nodes(target, out, nnodes=nnodes, nproc=nproc)
        return
    done = subprocess.run(
        [sys.executable, *target], env=loopback_env(), cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def _same_training(a: Path, b: Path, steps=None) -> None:
    """The data-parallel tests' tolerance (tests/parallel/test_distributed_training.py)."""
    ma = [m for m in read_metrics(a / "metrics.jsonl") if steps is None or m["step"] in steps]
    mb = [m for m in read_metrics(b / "metrics.jsonl") if steps is None or m["step"] in steps]
    assert [m["step"] for m in ma] == [m["step"] for m in mb] and ma
    for x, y in zip(ma, mb):
        for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/loss", "val/accuracy"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final_model" / "model.safetensors"))


def _same_weights(a: Path, b: Path, exact: bool = False) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        if exact:
            assert torch.equal(wa[name], wb[name]), name
        else:
            torch.testing.assert_close(wb[name], wa[name], atol=2e-6, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir):
    """3 uninterrupted GRPO steps in one process, a checkpoint after each."""
    run = tmp_path_factory.mktemp("straight") / "run"
    _train(_train_options(tiny_model_dir, run), run.parent / "out")
    return run


@pytest.fixture(scope="module")
def on_two_nodes(tmp_path_factory, tiny_model_dir):
    """The same 3 steps on two nodes of one rank each (FSDP over both)."""
    run = tmp_path_factory.mktemp("two_nodes") / "run"
    _train(_train_options(tiny_model_dir, run), run.parent / "out", nnodes=2)
    return run


@pytest.mark.slow
def test_grpo_on_two_nodes_trains_like_one_process(straight, on_two_nodes):
    _same_training(straight, on_two_nodes)
    _same_weights(straight, on_two_nodes)


@pytest.mark.slow
def test_hsdp_across_two_nodes_and_its_checkpoints_move_between_one_and_two_nodes(
    tmp_path, tiny_model_dir, straight
):
    """HSDP across the nodes (fsdp_size = 1 rank per node: replicate across nodes, shard within) trains as one
    process does; its step-2 checkpoint resumes on one process and on two nodes, and the one-process run's
    step-2 checkpoint on two nodes, each to the uninterrupted run's weights. (Resuming is compared with the
    run of the same trainer.total_steps: the learning-rate schedule spans them.)"""
    hsdp = {"actor.fsdp_config.fsdp_size": 1, "ref.fsdp_config.fsdp_size": 1}
    two = tmp_path / "two"
    _train(_train_options(tiny_model_dir, two, **hsdp), tmp_path / "o2", nnodes=2)
    _same_training(straight, two)
    _same_weights(straight, two)
    for name, source, nnodes in (("on_one", two, 0), ("on_two", two, 2), ("from_one", straight, 2)):
        run = tmp_path / name
        resume = {"trainer.resume": source / "checkpoints" / "step_000002"}
        _train(_train_options(tiny_model_dir, run, **hsdp, **resume), tmp_path / f"o_{name}", nnodes)
        _same_training(straight, run, steps={3})
        _same_weights(straight, run)


# --- posttrain rm ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rm_on_two_nodes_trains_like_one_process(tmp_path, tiny_model_dir):
    from posttrain.rm.demo import write_arithmetic_pairs
    from tests.rm.test_rm_ranks import _args, _same_metrics
    from tests.rm.test_rm_ranks import _same_weights as same_rm_weights

    data = tmp_path / "pairs"
    write_arithmetic_pairs(data, n_train=16, n_val=7, seed=3)
    one, two = tmp_path / "one", tmp_path / "two"
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "rm", *_args(tiny_model_dir, data, one)],
        env=loopback_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    run_on_nodes(["-m", "posttrain", "rm", *_args(tiny_model_dir, data, two)], tmp_path / "out", nnodes=2)
    _same_metrics(one, two)
    same_rm_weights(one, two)


# --- failures -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_node_killed_mid_step_stops_the_other_and_the_same_command_resumes_bit_exact(
    tmp_path, tiny_model_dir, on_two_nodes
):
    """SIGKILL node 1 (its launcher and its rank, as a machine failure does) during step 2: node 0 stops within
    a bounded time with one message naming the cause, the last checkpoint is complete and nothing half-written
    is published, and the same command on two nodes resumes from it to the uninterrupted run's weights, bit
    for bit."""
    run = tmp_path / "run"
    args = _train_options(tiny_model_dir, run, **{"trainer.dist_timeout_s": 30})
    target = ["-m", "posttrain", "train", *args]
    with nodes(target, tmp_path / "killed") as started:
        _wait_for([run / "checkpoints" / "step_000001" / "COMPLETE"], started, timeout=300)
        victims = [started[1].proc.pid, *children(started[1].proc.pid)]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        code = started[0].proc.wait(timeout=120)
        took = time.monotonic() - killed
        said = started[0].output()
    assert code != 0
    assert took < 30 + 30, f"node 0 took {took:.0f} s to stop"
    assert said.count("another rank has probably died or hung") == 1, said[-4000:]
    print(f"node 0 stopped {took:.1f} s after node 1 was killed")
    checkpoints = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert all((run / "checkpoints" / c / "COMPLETE").exists() for c in checkpoints), checkpoints
    assert "step_000003" not in checkpoints and not (run / "final_model").exists()
    run_on_nodes(target, tmp_path / "resumed")  # the same command: trainer.resume=auto
    assert "Resumed from" in (tmp_path / "resumed" / "node0.log").read_text()
    _same_weights(on_two_nodes, run, exact=True)
    after = [m for m in read_metrics(run / "metrics.jsonl") if m["step"] == 3]
    before = [m for m in read_metrics(on_two_nodes / "metrics.jsonl") if m["step"] == 3]
    for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/loss", "actor/entropy"):
        assert after[-1][key] == before[0][key], key


def test_a_node_that_never_joins_ends_the_launch_at_torchruns_join_timeout(tmp_path):
    """One launcher of two: torchrun's c10d rendezvous gives up after its join_timeout (600 s unless
    ``--rdzv-conf join_timeout=`` says otherwise) with torch's RendezvousTimeoutError; no rank is started."""
    out = tmp_path / "out"
    with nodes([str(WORKERS), "mesh", str(out), "fsdp_size=1"], out, join=1, join_timeout_s=3) as started:
        began = time.monotonic()
        assert wait_all(started, 120) == [1]
        took = time.monotonic() - began
        said = started[0].output()
    assert "RendezvousTimeoutError" in said, said[-3000:]
    assert took < 60, took
    assert not list(out.glob("mesh_*.json"))


def test_ranks_that_never_meet_end_with_a_rendezvous_timeout_naming_the_address(tmp_path):
    """Ranks given torch.distributed's variables by hand (as on nodes a scheduler starts): rank 0 of 2 alone,
    and rank 1 of 2 whose rank 0 never listens, each stop after the timeout (trainer.dist_timeout_s) with a
    config error naming MASTER_ADDR and MASTER_PORT (the CLI prints it as one line, exit 2), not a hang."""
    procs = []
    for rank in (0, 1):
        port = str(free_port())
        env = loopback_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_PORT=port, GROUP_RANK="0")
        env.pop("LOCAL_WORLD_SIZE", None)
        cmd = [sys.executable, str(WORKERS), "mesh", str(tmp_path), "fsdp_size=1", "timeout_s=3"]
        procs.append(
            (rank, port, subprocess.Popen(cmd, env=env, cwd=REPO, stderr=subprocess.PIPE, text=True))
        )
    for rank, port, proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        said = err.strip().splitlines()[-1]
        assert said.startswith(f"posttrain.config.errors.ConfigError: rank {rank} of 2"), err[-3000:]
        assert f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} for trainer.dist_timeout_s=3 s" in said, said
