"""A cluster that grows: Ray's autoscaler (v1, as the cluster launcher runs it) with its fake
multi-node provider, which starts real Ray nodes on this machine when the autoscaler asks
for them. Its node types are cluster.yaml's scaled down: a head for the driver and the
policy's bundles, and CPU nodes carrying the `rayrep_cpu_node` resource (cluster.yaml's
cpu_32), on which the verifiers must go.

Ray's `AutoscalingCluster` helper is not used: it reads an example config the wheel lacks
and runs `ray stop --force`, which would stop every Ray process on the machine. The head
is started here and stopped through the processes it started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ray_nodes import kill_session, start_ray_node, stop_ray_node, wait_for_head
from rayrep.cluster.placement import free_port

pytestmark = pytest.mark.slow  # an autoscaling Ray cluster of its own

ROOT = Path(__file__).resolve().parents[1]
CPU_NODES = 2  # the CPU node type's max_workers


def autoscaler_config(gcs_address: str) -> dict:
    small_store = 200 * 2**20
    return {
        "cluster_name": "rayrep-autoscaling-test",
        "max_workers": CPU_NODES,
        "idle_timeout_minutes": 0.1,  # idle nodes go after 6 s
        "upscaling_speed": 2.0,
        # As Ray's own fake-cluster config has it: no updaters (nothing to set up on a node
        # started in-process), and nodes known by id (they all share this machine's address).
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "use_node_id_as_ip": True},
        "auth": {"ssh_user": "ubuntu"},
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
            "cpu_1": {"resources": {"CPU": 1, "rayrep_cpu_node": 1, "object_store_memory": small_store},
                      "node_config": {}, "min_workers": 0, "max_workers": CPU_NODES},
        },
        **{key: [] for key in ("initialization_commands", "setup_commands", "head_setup_commands",
                               "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands",
                               "cluster_synced_files", "rsync_exclude", "rsync_filter")},
        "file_mounts": {}, "file_mounts_sync_continuously": False,
    }


@pytest.fixture(scope="module")
def autoscaling_cluster():
    """(address, the autoscaler's config file, the environment to reach it with)."""
    import ray._private.services

    temp_dir = tempfile.mkdtemp(prefix="rras-", dir="/tmp")  # short: Ray's unix sockets live here
    port = free_port()
    address = f"{ray._private.services.get_node_ip_address()}:{port}"
    config = Path(temp_dir) / "autoscaler.json"
    config.write_text(json.dumps(autoscaler_config(address)))
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    head = start_ray_node("--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false",
                          "--temp-dir", temp_dir, "--object-store-memory", str(500 * 2**20),
                          f"--autoscaling-config={config}",
                          env=dict(env, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1"))
    try:
        wait_for_head(address, head, env, deadline=time.monotonic() + 120)
        yield address, str(config), dict(env, RAY_ADDRESS=address)
    finally:
        stop_ray_node(head)
        kill_session(head.pid)  # the nodes the autoscaler started from it
        shutil.rmtree(temp_dir, ignore_errors=True)


def cpu_nodes(env: dict) -> int:
    """How many nodes carrying `rayrep_cpu_node` are alive now."""
    script = ("import ray; ray.init(log_to_driver=False); "
              "print('cpu nodes', sum(n['Alive'] and 'rayrep_cpu_node' in n['Resources'] for n in ray.nodes()))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(next(line for line in done.stdout.splitlines() if line.startswith("cpu nodes ")).split()[-1])


def grpo_job(env: dict, config: str, out_dir: Path, verifiers: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "grpo.py"), "--run.steps", "1", "--run.eval_every", "0",
         "--algorithm.prompts_per_step", "16", "--learner.mini_batch_prompts", "8", "--data.arithmetic_test_size", "16",
         "--verifier.num_workers", str(verifiers), "--verifier.cpus_per_worker", "1",
         "--placement.cpu_node_resource", "rayrep_cpu_node",
         "--placement.autoscaling_config", config, "--placement.wait_timeout_s", "300",
         "--logging.out_dir", str(out_dir), "--logging.run_name", f"autoscaled-{verifiers}"],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)


def test_a_plan_that_needs_two_more_nodes_grows_the_cluster_runs_and_the_idle_nodes_go(autoscaling_cluster,
                                                                                        tmp_path):
    _, config, env = autoscaling_cluster
    assert cpu_nodes(env) == 0
    # Two verifiers, each a bundle of 1 CPU on a CPU node: the autoscaler must add both.
    done = grpo_job(env, config, tmp_path, verifiers=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "autoscaled-2" / "metrics.jsonl").read_text().splitlines()]
    # The verifiers answered: both CPU nodes were added for them (each holds one 1-CPU bundle).
    assert [r["step"] for r in records] == [0, 1] and records[-1]["verifier_ok"] > 0
    deadline = time.monotonic() + 180
    while cpu_nodes(env):  # idle, they go
        assert time.monotonic() < deadline, "the idle CPU nodes were not removed within 180 s"
        time.sleep(1)  # (each look takes a few seconds itself: a new Ray driver)


def test_a_plan_beyond_the_node_types_maximum_fails_at_once_naming_it(autoscaling_cluster, tmp_path):
    _, config, env = autoscaling_cluster
    start = time.monotonic()
    done = grpo_job(env, config, tmp_path, verifiers=5)  # 5 CPU nodes' worth; the type allows 2
    assert done.returncode != 0
    message = done.stdout + done.stderr
    assert "cannot grow to hold the plan" in message and "rayrep_cpu_node" in message, message[-3000:]
    assert "Traceback" not in message, message[-3000:]
    assert time.monotonic() - start < 120  # not the 300 s wait: refused before any actor starts
