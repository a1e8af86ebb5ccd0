"""Trainer ranks placed by Ray (`trainer.ray_ranks`): two Ray-placed ranks train as one process does (the
distributed tests prove 2 torchrun ranks do, to the same tolerance), a rank that dies restarts the job from
the last checkpoint to the uninterrupted result, without restarts the run stops with a message and an intact
checkpoint; the user errors are config errors before Ray starts; explain plans for the Ray ranks.

Ray is an optional extra (``posttrain[ray]``, part of ``[dev]``): CI installs it, so there these tests must
run; elsewhere they skip when it is missing. The ranks run gloo on this machine's CPUs, one thread each."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.rl.ray_ranks import rank_envs, run_on_ray
from posttrain.rl.train_command import run_training
from posttrain.train.checkpoint import list_checkpoints
from posttrain.utils.crash_hook import VARIABLE as CRASH
from tests.helpers import read_metrics, small_config, small_overrides
from tests.local_ray import local_ray
from tests.sockets import is_loopback

if os.environ.get("CI") != "true":
    pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]
# Bounded: a job that hangs (or a machine too busy to start the ranks) fails, and the fixture stops Ray.
pytestmark = pytest.mark.timeout(900)

STEPS = ("trainer.total_steps=3", "trainer.test_freq=3", "trainer.export_hf=false")
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
def ray_instance(tmp_path_factory):
    """One local Ray instance for the module (the driver joins it rather than starting its own), on loopback,
    gone with the module (tests/local_ray.py)."""
    # 3 logical CPUs: two trainer ranks and a rollout worker (the ranks run one thread each).
    with local_ray(tmp_path_factory.mktemp("ray"), num_cpus=3) as ray:
        yield ray


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """The reference: the same run on this process alone."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    run_training(small_config(tiny_model_dir, run_dir, *STEPS), quiet=True)
    return {m["step"]: m for m in read_metrics(run_dir)}


def _same_training(reference: dict, metrics: list[dict], steps) -> None:
    """Same rewards (hence the same samples) and the same losses, as the distributed tests compare them."""
    got = {m["step"]: m for m in metrics}  # a resumed run's lines for a step come last
    for step in steps:
        for key in COMPARED:
            assert (key in got[step]) == (key in reference[step]), (step, key)
            if key in reference[step]:
                assert got[step][key] == pytest.approx(reference[step][key], rel=1e-4, abs=1e-6), (step, key)


def _no_groups_left(ray) -> bool:
    return all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


@pytest.mark.dist
def test_two_ray_ranks_train_like_one_process(ray_instance, one_process, tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    last = run_on_ray(small_config(tiny_model_dir, run_dir, *STEPS, *RAY2))
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    _same_training(one_process, metrics, (0, 1, 2, 3))
    assert last["reward/mean"] == metrics[-1]["reward/mean"]  # rank 0's final metrics come back
    assert "Ray placed 2 trainer ranks" in capsys.readouterr().out
    assert _no_groups_left(ray_instance)

    # A ConfigError raised inside the ranks (here: the run is finished) is the CLI's exit 2, not a restart.
    code = main(
        ["train", *small_overrides(tiny_model_dir, run_dir, *STEPS, *RAY2, "trainer.ray_max_restarts=1")]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "trainer rank" in err and "already holds a finished run" in err and "restarting" not in err


@pytest.mark.dist
def test_a_dead_rank_restarts_all_ranks_from_the_last_checkpoint(
    ray_instance, one_process, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(CRASH, f"1:3:{tmp_path / 'crashed'}")  # rank 1 dies at the start of step 3, once
    run_dir = tmp_path / "run"
    extra = (*STEPS, *RAY2, "trainer.save_freq=1", "trainer.ray_max_restarts=1")
    run_on_ray(small_config(tiny_model_dir, run_dir, *extra))
    err = capsys.readouterr().err
    # Rank 1 exits; rank 0, its collective broken, ends too: on a busy machine Ray may report either first.
    assert re.search(r"rank [01] died", err), err
    assert "restarting 2 ranks from the last checkpoint (restart 1 of 1)" in err
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]  # steps 1-2 by the first ranks, 3 after the resume
    _same_training(one_process, metrics, (0, 1, 2, 3))
    assert list_checkpoints(run_dir)[-1].name == "step_000003"
    assert _no_groups_left(ray_instance)


@pytest.mark.dist
def test_without_restarts_a_dead_rank_stops_the_run_and_the_checkpoint_is_intact(
    ray_instance, one_process, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(CRASH, f"1:2:{tmp_path / 'crashed'}")
    run_dir = tmp_path / "run"
    code = main(["train", *small_overrides(tiny_model_dir, run_dir, *STEPS, *RAY2, "trainer.save_freq=1")])
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.search(r"rank [01] died", err) and "run the same command to resume" in err
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000001"]
    assert _no_groups_left(ray_instance)
    # The checkpoint the two ranks wrote resumes (here on one process) to the uninterrupted run.
    run_training(small_config(tiny_model_dir, run_dir, *STEPS), quiet=True)
    _same_training(one_process, read_metrics(run_dir), (2, 3))


@pytest.mark.dist
def test_a_dead_rank_0_restarts_too(ray_instance, one_process, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Rank 0 holds run_dir's lock: the restarted rank 0 takes it over from the dead one's process."""
    monkeypatch.setenv(CRASH, f"0:2:{tmp_path / 'crashed'}")
    run_dir = tmp_path / "run"
    extra = (*STEPS, *RAY2, "trainer.save_freq=1", "trainer.ray_max_restarts=1")
    run_on_ray(small_config(tiny_model_dir, run_dir, *extra))
    assert "restarting 2 ranks from the last checkpoint (restart 1 of 1)" in capsys.readouterr().err
    _same_training(one_process, read_metrics(run_dir), (2, 3))


@pytest.mark.dist
def test_ray_ranks_fed_by_a_ray_rollout_worker_train_like_one_process(ray_instance, tiny_model_dir, tmp_path):
    """Both roles placed by Ray: two trainer ranks and one rollout worker one step ahead give the run of one
    trainer process with the same worker (validation included, through rank 0's worker)."""
    ahead = (
        "async_training.enable=true",
        "async_training.rollout_worker=ray",
        "async_training.max_staleness=1",
    )
    reference_dir = tmp_path / "one"
    run_training(small_config(tiny_model_dir, reference_dir, *STEPS, *ahead), quiet=True)
    run_dir = tmp_path / "run"
    run_on_ray(small_config(tiny_model_dir, run_dir, *STEPS, *ahead, *RAY2))
    metrics = read_metrics(run_dir)
    _same_training({m["step"]: m for m in read_metrics(reference_dir)}, metrics, (0, 1, 2, 3))
    assert [m["async/policy_lag_max"] for m in metrics if m["step"] > 0] == [0.0, 1.0, 1.0]
    assert _no_groups_left(ray_instance)


# A reward function that writes, once per reward worker, what the worker and its trainer rank (the process it
# was forked from) listen on.
PROBE = """
import json, os, sys
sys.path.insert(0, {repo!r})
from tests.sockets import listening_sockets

def probe(prompt, response, ground_truth, extra):
    out = os.path.join({out!r}, f"{{os.getpid()}}.json")
    if not os.path.exists(out):
        report = dict(rank=os.environ["RANK"], trainer=listening_sockets(os.getppid()), worker=listening_sockets(os.getpid()))
        with open(out, "w") as f:
            json.dump(report, f)
    return float(len(response) % 3)
"""


@pytest.mark.dist
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ray_ranks_listen_on_loopback_and_their_reward_workers_not_at_all(
    ray_instance, tiny_model_dir, tmp_path
):
    reports = tmp_path / "reports"
    reports.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(repo=str(REPO), out=str(reports)))
    one_step = ("trainer.total_steps=1", "trainer.test_freq=0", "trainer.export_hf=false")
    workers = (f"reward.function={probe}:probe", "reward.timeout_s=60")
    overrides = small_overrides(tiny_model_dir, tmp_path / "run", *one_step, *RAY2)
    mine = [o for o in overrides if not o.startswith(("reward.function=", "reward.timeout_s="))]
    run_on_ray(build_config(overrides=[*mine, *workers]))
    found = [json.loads(path.read_text()) for path in reports.iterdir()]
    assert sorted({r["rank"] for r in found}) == ["0", "1"], found
    for report in found:
        trainer = list(report["trainer"].values())
        # rank 0: the store, gloo and Ray's own worker port; rank 1: gloo and Ray's
        assert len(trainer) >= (3 if report["rank"] == "0" else 2), report
        assert all(is_loopback(a) for a in trainer), report
        assert report["worker"] == {}, report


def test_ranks_ray_cannot_place_are_a_config_error(ray_instance, tiny_model_dir, tmp_path, monkeypatch):
    from posttrain.rl import ray_ranks

    monkeypatch.setattr(ray_ranks, "PLACEMENT_TIMEOUT_S", 1)
    cfg = small_config(tiny_model_dir, tmp_path / "run", *STEPS, *RAY2, "trainer.ray_cpus_per_rank=2")
    with pytest.raises(ConfigError, match=r"could not place 2 trainer ranks \(\{'CPU': 2\} each.* free"):
        run_on_ray(cfg)  # the instance has 3 CPUs, the ranks ask for 4
    assert _no_groups_left(ray_instance)


def _train_error(capsys, tiny_model_dir, tmp_path, *extra) -> str:
    code = main(["train", *small_overrides(tiny_model_dir, tmp_path / "run", *extra)])
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def test_launch_errors_are_config_errors_before_ray_starts(tiny_model_dir, tmp_path, monkeypatch, capsys):
    err = _train_error(capsys, tiny_model_dir, tmp_path, "trainer.ray_ranks=3")
    assert "3 data-parallel ranks" in err  # the batch plan, for the ranks Ray would start
    err = _train_error(capsys, tiny_model_dir, tmp_path, "trainer.ray_placement=SPREAD")
    assert "trainer.ray_placement=SPREAD" in err and "trainer.ray_ranks=0" in err
    err = _train_error(
        capsys, tiny_model_dir, tmp_path, *RAY2, "trainer.ray_gpus_per_rank=1", "trainer.device=cpu"
    )
    assert "trainer.ray_gpus_per_rank=1" in err and "trainer.device=cpu" in err
    err = _train_error(capsys, tiny_model_dir, tmp_path, "async_training.ray_address=auto")
    assert "unknown config key 'async_training.ray_address'; did you mean 'trainer.ray_address'" in err
    err = _train_error(capsys, tiny_model_dir, tmp_path, *RAY2, "async_training.enable=true")
    assert "rollout_worker=thread needs one trainer process, but the world size is 2" in err
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _train_error(capsys, tiny_model_dir, tmp_path, *RAY2)
    assert "already one of 2 ranks" in err and "torchrun" in err
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    err = _train_error(capsys, tiny_model_dir, tmp_path, *RAY2)
    assert "Ray is not installed" in err and "posttrain[ray]" in err


def test_explain_plans_for_the_ray_ranks(capsys):
    assert (
        main(["explain", "trainer.ray_ranks=2", "trainer.ray_max_restarts=1", "trainer.ray_placement=SPREAD"])
        == 0
    )
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # rich wraps long lines
    assert "(world size 2)" in out
    assert (
        "trainer ranks: 2 processes placed by Ray (trainer.ray_ranks) on a Ray instance on this machine, "
        "1 CPU(s) each, placement SPREAD" in out
    )
    assert "up to 1 time(s) (trainer.ray_max_restarts)" in out
    assert main(["explain", "trainer.ray_ranks=2", "--world-size", "4"]) == 2
    assert "disagrees with trainer.ray_ranks=2" in capsys.readouterr().err


def test_rank_environments_follow_torchrun():
    """LOCAL_RANK counts the ranks of a node; a GPU rank sees its node's GPUs, its own at LOCAL_RANK."""
    places = [("a", "10.0.0.1", ["3"]), ("b", "10.0.0.2", ["0"]), ("a", "10.0.0.1", ["5"])]
    envs = rank_envs(places, 29500, cpus=4, attempt=1)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [("0", "2"), ("0", "1"), ("1", "2")]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["OMP_NUM_THREADS"]) for e in envs} == {
        ("10.0.0.1", "29500", "4")
    }
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,5", "0", "3,5"]
    assert not any("GLOO_SOCKET_IFNAME" in e for e in envs)  # a cluster's network is the user's choice
    cpu = rank_envs([("a", "10.0.0.1", []), ("a", "10.0.0.1", [])], 1, cpus=1, attempt=0)
    assert "CUDA_VISIBLE_DEVICES" not in cpu[0]
    # Ray started here: its node address is loopback, and so is every rank's torch.distributed.
    local = rank_envs([("a", "127.0.0.1", []), ("a", "127.0.0.1", [])], 1, cpus=1, attempt=0)
    assert {(e["MASTER_ADDR"], e["GLOO_SOCKET_IFNAME"]) for e in local} == {("127.0.0.1", "lo")}


def test_the_ray_knobs_are_config_errors_without_ray_ranks():
    with pytest.raises(ConfigError, match="trainer.ray_max_restarts=2 .* trainer.ray_ranks=0"):
        build_config(overrides=["trainer.ray_max_restarts=2"])
    with pytest.raises(ConfigError, match="trainer.ray_gpus_per_rank=0"):
        build_config(overrides=["trainer.ray_ranks=2", "trainer.device=cuda"])
    assert build_config(overrides=["trainer.ray_address=auto"]).trainer.ray_address == "auto"
