"""A Ray instance posttrain starts itself listens on loopback only (Ray has no authentication by default: a Ray
head reachable from the network runs anyone's code), its ranks' torch.distributed binds to loopback, and the
tests' Ray instances leave no process or file behind, even when the test process is killed.

Ray is an optional extra (``posttrain[ray]``, part of ``[dev]``): CI installs it, so there these tests must
run; elsewhere they skip when it is missing. Linux only (they read /proc)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.parallel.rendezvous import loopback_gloo_env
from tests.local_ray import local_ray, processes_of
from tests.sockets import is_loopback, listening_addresses

if os.environ.get("CI") != "true":
    pytest.importorskip("ray")
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.timeout(300),
]
REPO = Path(__file__).resolve().parents[2]


def test_a_local_ray_listens_on_loopback_only(tmp_path):
    me = os.getpid()
    before = set(listening_addresses([me]).get(me, []))  # this process's own, from earlier tests
    with local_ray(tmp_path, num_cpus=1) as ray:

        @ray.remote
        def where():
            return os.getpid(), ray.util.get_node_ip_address()

        worker, node_ip = ray.get(where.remote())  # a worker process runs, listening too
        pids = [me, *processes_of(me)]
        assert worker in pids
        listening = listening_addresses(pids)
        listening[me] = [a for a in listening.get(me, []) if a not in before]  # the driver's Ray sockets
        addresses = [a for found in listening.values() for a in found]
        assert node_ip == "127.0.0.1"
        assert len(addresses) >= 3, listening  # the GCS, the raylet, the workers: they were read
        assert all(is_loopback(a) for a in addresses), listening


def test_ranks_on_a_loopback_node_bind_gloo_to_loopback():
    assert loopback_gloo_env("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo"}
    assert loopback_gloo_env("10.0.0.1") == {}


KILLED = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.local_ray import local_ray, processes_of
with local_ray(Path(sys.argv[1]), num_cpus=1) as ray:
    ray.get(ray.remote(lambda: 1).remote())
    print(json.dumps([os.readlink(Path(sys.argv[1]) / "ray-session"), processes_of(os.getpid())]), flush=True)
    time.sleep(600)
"""


def test_a_killed_test_process_leaves_no_ray_process_or_file_behind(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(tmp_path), str(REPO)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        temp_dir, pids = json.loads(proc.stdout.readline())
        ray_pids = [pid for pid in pids if "ray" in _name(pid)]
        assert len(ray_pids) >= 3 and Path(temp_dir).is_dir()  # the GCS, the raylet, a worker...
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 60
    while (any(_alive(pid) for pid in ray_pids) or Path(temp_dir).exists()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in ray_pids if _alive(pid)]
    assert not Path(temp_dir).exists()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
