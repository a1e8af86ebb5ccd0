"""A Ray cluster of two nodes on this machine (tests/ray_nodes.py: a head, and a second node offering the custom
resource ``node1``), joined by `trainer.ray_address`: every process of it listens on loopback only; the trainer
ranks (`trainer.ray_resources_per_rank`) and the rollout worker (`async_training.rollout_resources`) run on the
second node, as they find themselves, and train as the one-trainer-process run does; the second node's raylet
killed mid-run stops the run within a bounded time with one message, its checkpoint intact.

Ray is an optional extra (``posttrain[ray]``, part of ``[dev]``): CI installs it, so there these tests must
run; elsewhere they skip when it is missing. Linux only (they read /proc)."""

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.rl.ray_ranks import run_on_ray
from posttrain.rl.train_command import run_training
from posttrain.train.checkpoint import list_checkpoints
from tests.helpers import read_metrics, small_config, small_overrides
from tests.local_ray import processes_of
from tests.ray_nodes import two_ray_nodes
from tests.sockets import is_loopback, listening_addresses

if os.environ.get("CI") != "true":
    pytest.importorskip("ray")
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.timeout(900),
]

STEPS = ("trainer.total_steps=2", "trainer.test_freq=2", "trainer.export_hf=false")
AHEAD = ("async_training.enable=true", "async_training.rollout_worker=ray", "async_training.max_staleness=1")
ON_NODE1 = ("trainer.ray_resources_per_rank.node1=1",)
WORKER_ON_NODE1 = ("async_training.rollout_resources.node1=1",)
RAY2 = ("trainer.ray_ranks=2",)
COMPARED = (
    "reward/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/loss",
    "actor/entropy",
    "val/accuracy",
)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    # The head has 1 CPU and no node1; the second node room for two ranks and the rollout worker.
    with two_ray_nodes(tmp_path_factory.mktemp("ray"), head_cpus=1, node_cpus=3, resources={"node1": 3}) as n:
        yield n


def _same_training(reference: list[dict], metrics: list[dict], steps) -> None:
    """Same rewards and losses, at the tolerances of the data-parallel tests (tests/parallel/test_ray_ranks.py)."""
    ref, got = {m["step"]: m for m in reference}, {m["step"]: m for m in metrics}
    for step in steps:
        for key in COMPARED:
            assert (key in got[step]) == (key in ref[step]), (step, key)
            if key in ref[step]:
                assert got[step][key] == pytest.approx(ref[step][key], rel=1e-4, abs=1e-6), (step, key)


@pytest.mark.dist
def test_two_nodes_listen_on_loopback_and_the_second_offers_its_resource(nodes, tmp_path):
    import ray

    from posttrain.parallel.ray_local import start_or_join

    me = os.getpid()
    before = set(listening_addresses([me]).get(me, []))
    assert start_or_join(ray, nodes.address)  # joined, not started: the driver of trainer.ray_address
    try:
        alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        assert set(alive) == {nodes.head, nodes.node}
        assert alive[nodes.node]["Resources"]["node1"] == 3 and "node1" not in alive[nodes.head]["Resources"]
        assert {n["NodeManagerAddress"] for n in alive.values()} == {"127.0.0.1"}

        @ray.remote(num_cpus=1, resources={"node1": 1})
        def where():
            return ray.get_runtime_context().get_node_id()

        assert ray.get(where.remote()) == nodes.node
        listening = listening_addresses(nodes.pids())
        listening[me] = [a for a in listening_addresses([me]).get(me, []) if a not in before]
        addresses = [a for found in listening.values() for a in found]
        assert len(addresses) >= 6, listening  # two GCS-or-raylet sets and workers: they were read
        assert all(is_loopback(a) for a in addresses), listening
    finally:
        ray.shutdown()


@pytest.mark.dist
@pytest.mark.slow
def test_ranks_and_rollout_worker_on_the_second_node_train_like_one_process(
    nodes, tiny_model_dir, tmp_path, capsys, caplog
):
    """The reference: one trainer process (this one) fed by a Ray rollout worker on the second node; then two
    Ray-placed trainer ranks on the second node fed by the same worker there: the same training."""
    join = (f"trainer.ray_address={nodes.address}", "trainer.export_hf=true")  # final_model/: the weights
    reference_dir = tmp_path / "one"
    with caplog.at_level(logging.INFO, logger="posttrain"):
        run_training(small_config(tiny_model_dir, reference_dir, *STEPS, *AHEAD, *WORKER_ON_NODE1, *join))
    assert f"on node {nodes.node}" in caplog.text, caplog.text  # the worker's own view of where it runs
    run_dir = tmp_path / "run"
    run_on_ray(
        small_config(tiny_model_dir, run_dir, *STEPS, *AHEAD, *WORKER_ON_NODE1, *RAY2, *ON_NODE1, *join)
    )
    out = capsys.readouterr().out
    placed = re.search(r"Ray placed 2 trainer ranks \(.*'node1': 1.*\) on (.*); rank 0", out)
    assert placed and placed.group(1) == f"127.0.0.1 (node {nodes.node})", out  # both ranks, as they found
    metrics = read_metrics(run_dir)
    _same_training(read_metrics(reference_dir), metrics, (0, 1, 2))
    assert [m["async/policy_lag_max"] for m in metrics if m["step"] > 0] == [0.0, 1.0]
    # and the same weights, to the data-parallel tests' tolerance (tests/parallel/test_two_nodes.py)
    ref = load_file(str(reference_dir / "final_model" / "model.safetensors"))
    got = load_file(str(run_dir / "final_model" / "model.safetensors"))
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.dist
@pytest.mark.slow
def test_the_second_node_killed_mid_run_stops_the_run_with_one_message(tiny_model_dir, tmp_path, capsys):
    """The second node's raylet and its workers SIGKILLed after the step-1 checkpoint: the command ends (exit 1) within a
    bounded time, says which rank died and that the checkpoint is intact, and that checkpoint resumes."""
    run_dir = tmp_path / "run"
    steps = ("trainer.total_steps=8", "trainer.test_freq=0", "trainer.export_hf=false", "trainer.save_freq=1")
    killed: dict[str, float] = {}

    def kill_after_first_checkpoint(raylet: int) -> None:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step_000001").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in [
            raylet,
            *processes_of(raylet),
        ]:  # the node's raylet and its workers (the ranks): the node dies
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed["at"] = time.monotonic()

    with two_ray_nodes(tmp_path, head_cpus=1, node_cpus=2, resources={"node1": 2}) as n:
        killer = threading.Thread(target=kill_after_first_checkpoint, args=(n.raylet,), daemon=True)
        killer.start()
        args = small_overrides(
            tiny_model_dir, run_dir, *steps, *RAY2, *ON_NODE1, f"trainer.ray_address={n.address}"
        )
        code = main(["train", *args])
        stopped_after = time.monotonic() - killed["at"]
        err = capsys.readouterr().err
    print(f"the run stopped {stopped_after:.1f} s after the second node's raylet was killed")
    assert code == 1, err
    assert stopped_after < 120, stopped_after
    assert re.search(r"rank [01] died", err) and "run the same command to resume" in err, err
    assert err.count("posttrain train: error:") == 1, err
    done = [p.name for p in list_checkpoints(run_dir)]
    assert done and "step_000008" not in done, done
    # The run directory is intact: its last checkpoint resumes (here on one process) to the end.
    run_training(small_config(tiny_model_dir, run_dir, *steps, "trainer.resume=auto"), quiet=True)
    assert [m["step"] for m in read_metrics(run_dir)][-1] == 8


def test_custom_resources_are_checked_before_ray_starts():
    with pytest.raises(
        ConfigError, match=r"trainer.ray_resources_per_rank=\{'node1': 1\} .* trainer.ray_ranks=0"
    ):
        build_config(overrides=["trainer.ray_resources_per_rank.node1=1"])
    with pytest.raises(ConfigError, match=r"ray_resources_per_rank.CPU=2: CPU is not a custom resource"):
        build_config(overrides=[*RAY2, "trainer.ray_resources_per_rank.CPU=2"])
    with pytest.raises(ConfigError, match=r"ray_resources_per_rank.node1='a': .* a number > 0"):
        build_config(overrides=[*RAY2, "trainer.ray_resources_per_rank.node1=a"])
    with pytest.raises(ConfigError, match=r"rollout_resources.node1=0: .* a number > 0"):
        build_config(overrides=[*AHEAD, "async_training.rollout_resources.node1=0"])
    with pytest.raises(
        ConfigError, match=r"async_training.rollout_resources=\{'node1': 1\} .* rollout_worker=thread"
    ):
        build_config(overrides=["async_training.enable=true", "async_training.rollout_resources.node1=1"])
    cfg = build_config(overrides=[*RAY2, *ON_NODE1, *AHEAD, "async_training.rollout_resources.node1=0.5"])
    assert (cfg.trainer.ray_resources_per_rank, cfg.async_training.rollout_resources) == (
        {"node1": 1},
        {"node1": 0.5},
    )
