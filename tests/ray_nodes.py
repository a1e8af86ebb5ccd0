"""Two Ray nodes on this machine for the tests, both on loopback: a head and a second node with a custom
resource of its own, each with its own raylet, object store and workers, started by Ray's own multi-node
helper (``ray.cluster_utils.Cluster``) in a launcher process of their own, as `ray start` would start them on
two machines.

Why not two `ray start` commands: a node whose address is ``127.0.0.1`` keeps it (and listens on loopback
only) only while Ray's clusters are switched off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, as
posttrain.parallel.ray_local starts its own instance), and then `ray start --address` refuses to start a
second node ("Multi-node Ray clusters are not supported on Windows and OSX"); with clusters on, Ray turns
``127.0.0.1`` into the machine's external address, and nodes on other loopback addresses (``127.0.0.2``) listen
on every interface. The Python helper starts the second node without that check.

Everything the launcher started ends with the block: the launcher shuts the cluster down when its stdin closes,
and the watchdog of tests/local_ray.py kills whatever is left (also when the test process is killed) and
removes the session directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.local_ray import MARK, _start_watchdog, processes_of

LAUNCHER = r"""
import json, os, sys
temp_dir, head_cpus, node_cpus, resources = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # node addresses stay 127.0.0.1: loopback only
os.environ["RAY_TMPDIR"] = temp_dir  # where the helper writes the cluster's address file (not /tmp/ray)
os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
from ray.cluster_utils import Cluster

common = dict(node_ip_address="127.0.0.1", include_dashboard=False)
cluster = Cluster(initialize_head=True, head_node_args=dict(common, num_cpus=head_cpus, temp_dir=temp_dir))
node = cluster.add_node(**common, num_cpus=node_cpus, resources=resources)
print(json.dumps(dict(
    address=cluster.address,
    head=cluster.head_node.node_id,
    node=node.node_id,
    raylet=node.all_processes["raylet"][0].process.pid,
)), flush=True)
sys.stdin.read()  # until the test closes the pipe
cluster.shutdown()
"""


@dataclass
class TwoNodes:
    address: str  # the head's GCS, 127.0.0.1:PORT: what trainer.ray_address joins
    head: str  # node ids (hex)
    node: str  # the second node, the one with the custom resources
    raylet: int  # the second node's raylet process
    launcher: int  # the process both nodes' processes descend from

    def pids(self) -> list[int]:
        return [self.launcher, *processes_of(self.launcher)]


@contextmanager
def two_ray_nodes(tmp_path: Path, head_cpus: int, node_cpus: int, resources: dict[str, float]):
    """A head (``head_cpus`` CPUs) and a second node (``node_cpus`` CPUs and ``resources``) on loopback;
    yields their :class:`TwoNodes`. Nothing of them is left after the block."""
    temp_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's unix socket paths must fit in 107 bytes
    (tmp_path / "ray-session").symlink_to(temp_dir)
    token = uuid.uuid4().hex
    watchdog = _start_watchdog(f"{MARK}={token}", temp_dir)
    env = dict(os.environ, **{MARK: token})
    args = [sys.executable, "-c", LAUNCHER, temp_dir, str(head_cpus), str(node_cpus), json.dumps(resources)]
    launcher = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = launcher.stdout.readline()
        if not line:
            raise RuntimeError(f"the two Ray nodes did not start (launcher exit code {launcher.wait()})")
        yield TwoNodes(**json.loads(line), launcher=launcher.pid)
    finally:
        launcher.stdin.close()  # the launcher shuts the cluster down
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
        watchdog.stdin.close()  # anything left is killed, the directory removed
        watchdog.wait(timeout=30)
