"""Two Ray nodes on this machine: learners on one, generators on the other, weights synced across."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ray_nodes import RAY, start_ray_node, stop_ray_node, wait_for_head

from rayrep.cluster.placement import free_port

pytestmark = pytest.mark.slow  # a two-node Ray cluster of its own

# Token authentication is off for these two nodes: what this test is about is placement and
# the weight sync across nodes (the job-submit test runs with authentication on).
NO_AUTH = dict(os.environ, RAY_AUTH_MODE="disabled")


@pytest.fixture(scope="module")
def two_nodes(tiny_policy):
    """A head with 2 CPUs and a second node with 3, each naming itself with a custom resource;
    stopped through the processes we started (never `ray stop`)."""
    temp_dir = tempfile.mkdtemp(prefix="rr2-", dir="/tmp")  # short: Ray's unix sockets live here
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = start_ray_node("--head", "--port", str(port), "--num-cpus", "2", "--resources", '{"node_a": 1}',
                          "--include-dashboard", "false", "--temp-dir", temp_dir,
                          "--object-store-memory", str(500 * 2**20), env=NO_AUTH)
    second = None
    try:
        deadline = time.monotonic() + 120
        wait_for_head(address, head, NO_AUTH, deadline)
        second = start_ray_node("--address", address, "--num-cpus", "3", "--resources", '{"node_b": 1}',
                                "--object-store-memory", str(500 * 2**20), env=NO_AUTH)
        while "node_b" not in subprocess.run([RAY, "status", "--address", address], capture_output=True, text=True,
                                             env=NO_AUTH).stdout:
            if time.monotonic() > deadline or second.poll() is not None:
                raise RuntimeError("the second Ray node did not join")
            time.sleep(1)
        yield address
    finally:
        for process in (second, head):
            if process is not None:
                stop_ray_node(process)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_learners_and_generators_on_two_nodes_sync_across(two_nodes, tiny_policy):
    """Disaggregated: the learner's bundle (2 CPUs) and the generator's (2 CPUs) cannot share a
    node of 2 or 3 CPUs, so Ray places them on different nodes; the weight sync then crosses
    between the nodes, and the generator samples from the learner's weights, as on one node.
    The job is a driver process of its own (tests/two_node_job.py), as a submitted job is."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("two_node_job.py")), two_nodes, tiny_policy],
                          capture_output=True, text=True, timeout=600, env=NO_AUTH)
    assert done.returncode == 0, done.stderr[-3000:]
    report = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0] in
                  ("learner_node", "generator_node", "gap"))
    assert report["learner_node"] != report["generator_node"]
    assert float(report["gap"]) < 1e-3
