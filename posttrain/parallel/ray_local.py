"""Starting Ray on this machine, or joining a cluster (`trainer.ray_address`).

A Ray instance that posttrain starts itself serves this machine only, so it listens on loopback only: Ray's
GCS, raylet, workers and agents accept connections on their ports, and whoever reaches a Ray head can run
code on it. Ray binds to its node address, and turns a loopback node address into the machine's external
one unless Ray clusters are switched off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when ray is imported
and inherited by the processes Ray starts): a local start sets both, for the time of ``ray.init``, starts
no dashboard, and the ranks Ray places there get a loopback ``MASTER_ADDR`` (their node's address) and
``GLOO_SOCKET_IFNAME=lo`` (posttrain.parallel.rendezvous). Joining a cluster leaves its network setup to whoever
started it (docs/distributed.md says how to secure one), except for a cluster on this machine's loopback
(``127.0.0.1:PORT``, nodes started with that node address and Ray clusters switched off): Ray would turn that
address into the machine's external one and not find the cluster there, so it is joined with the switch off too.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from contextlib import contextmanager

LOOPBACK = "127.0.0.1"
CLUSTERS_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def start_or_join(ray, address: str = "", **init_options) -> bool:
    """Join the cluster at ``address``, or (empty) start a Ray instance on this machine bound to loopback;
    nothing when this process already joined one. Returns whether Ray was started or joined here (the
    caller then shuts it down). ``init_options`` go to ``ray.init`` (``num_cpus``, ``_temp_dir``)."""
    if ray.is_initialized():
        return False
    options = {"include_dashboard": False, "logging_level": logging.WARNING} | init_options
    if address and not _on_loopback(address):
        ray.init(address=address, **options)
        return True
    with _clusters_off(ray):
        if address:  # a cluster on this machine's loopback: Ray would look for it at the external address
            ray.init(address=address, **options)
        else:  # "local": a new instance even where another runs on this machine (that one may listen elsewhere)
            ray.init(address="local", _node_ip_address=LOOPBACK, **options)
    return True


def _on_loopback(address: str) -> bool:
    """Whether ``address`` (``host:port``) names a cluster on this machine's loopback."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@contextmanager
def _clusters_off(ray):
    import ray._private.ray_constants as constants  # the switch, as read when ray was imported

    before_env, before = os.environ.get(CLUSTERS_VARIABLE), getattr(constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[CLUSTERS_VARIABLE] = "0"
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before_env is None:
            os.environ.pop(CLUSTERS_VARIABLE, None)
        else:
            os.environ[CLUSTERS_VARIABLE] = before_env
        if before is None:
            del constants.ENABLE_RAY_CLUSTER
        else:
            constants.ENABLE_RAY_CLUSTER = before
