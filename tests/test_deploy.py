"""cluster.yaml (Ray's cluster launcher) and the KubeRay RayJob: valid, and shaped for the presets."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from rayrep.roles.system import run_plan
from rayrep.config import load_preset

ROOT = Path(__file__).resolve().parents[1]


def launcher_config() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def validated(config: dict) -> dict:
    """The checks `ray up` runs before it launches anything: defaults filled in, then Ray's schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    filled = prepare_config(copy.deepcopy(config))
    validate_config(filled)
    return filled


def test_cluster_yaml_passes_rays_own_validation():
    filled = validated(launcher_config())
    types = filled["available_node_types"]
    assert filled["provider"]["type"] == "aws" and filled["head_node_type"] == "head"
    assert types["head"]["resources"] == {"CPU": 0}
    gpu = types["gpu_8x_h100"]
    assert gpu["min_workers"] == 0 and gpu["resources"] == {"CPU": 192, "GPU": 8}
    assert types["cpu_32"]["resources"]["rayrep_cpu_node"] > 0
    # The schema check can fail: a misspelt field is refused.
    broken = launcher_config()
    broken["available_node_types"]["gpu_8x_h100"]["min_worker"] = 0
    with pytest.raises(Exception, match="min_worker"):
        validated(broken)


def test_cluster_yaml_installs_this_checkout_and_keeps_the_dashboard_private():
    config = launcher_config()
    assert config["file_mounts"]["~/rayrep"] == "."
    assert any('pip install -e "~/rayrep[gpu]"' in command for command in config["setup_commands"])
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    # Token authentication: Ray 2.60 turns it on by itself only for ray.init()'s local
    # clusters, so every node's `ray start` asks for it, with the token copied from this machine.
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = [command for command in config["head_start_ray_commands"] + config["worker_start_ray_commands"]
              if "ray start" in command]
    assert len(starts) == 2 and all(re.search(r"\bRAY_AUTH_MODE=token (\w+=\S+ )*ray start", command)
                                    for command in starts), starts


def node_capacity(config: dict) -> dict[str, tuple[dict, int]]:
    return {name: (spec["resources"], spec.get("max_workers", 0))
            for name, spec in config["available_node_types"].items() if name != config["head_node_type"]}


@pytest.mark.parametrize("preset", ["qwen2.5-math-7b-rlep", "qwen2.5-math-7b-exgrpo"])
def test_the_node_types_can_hold_each_presets_plan(preset):
    """Every placement group fits one node of some type, and the types' maximum counts hold
    the whole plan (GPU groups on GPU nodes, CPU roles on CPU nodes)."""
    config = launcher_config()
    types = node_capacity(config)
    plan = run_plan(load_preset(preset))
    for name, bundles in plan.groups.items():
        strict = plan.strategies[name] == "STRICT_PACK"
        shapes = [bundles] if strict else [[b] for b in bundles]  # STRICT_PACK: all on one node
        for shape in shapes:
            need = {k: sum(b.get(k, 0) for b in shape) for k in {k for b in shape for k in b}}
            assert any(all(res.get(k, 0) >= v for k, v in need.items()) for res, _ in types.values()), (name, need)
    for resource, needed in plan.total.items():
        available = sum(res.get(resource, 0) * count for res, count in types.values())
        assert available >= needed, (resource, needed, available)
    assert sum(count for _, count in types.values()) <= config["max_workers"]


def rayjob() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "kuberay-rayjob.yaml").read_text())


def test_the_rayjob_has_what_kuberay_requires():
    job = rayjob()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    spec = job["spec"]
    assert spec["entrypoint"].startswith("python jobs/rlep.py --preset qwen2.5-math-7b-rlep")
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    import ray

    assert cluster["rayVersion"] == ray.__version__  # the Ray the project is tested with
    head = cluster["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for group in [head] + cluster["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        assert container["name"] and container["image"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())  # KubeRay takes strings
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"] and 0 <= group["minReplicas"] <= group["maxReplicas"]
        assert group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]


def test_the_rayjob_agrees_with_cluster_yaml():
    """Same node shapes and the same maximum counts as the launcher config."""
    types = node_capacity(launcher_config())
    groups = {g["groupName"]: g for g in rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    gpu, cpu = groups["gpu-8x-h100"], groups["cpu-32"]
    (gpu_resources, gpu_max), (cpu_resources, cpu_max) = types["gpu_8x_h100"], types["cpu_32"]
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == int(gpu["rayStartParams"]["num-gpus"]) == gpu_resources["GPU"]
    assert int(gpu["rayStartParams"]["num-cpus"]) == gpu_resources["CPU"] and gpu["maxReplicas"] == gpu_max
    assert int(cpu["rayStartParams"]["num-cpus"]) == cpu_resources["CPU"] and cpu["maxReplicas"] == cpu_max
    assert '"rayrep_cpu_node": 32' in cpu["rayStartParams"]["resources"].replace('\\"', '"')
    head = rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # as cluster.yaml's head: the driver only


def dashboard() -> dict:
    import json

    return json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())


def dashboard_series() -> set[str]:
    """The series the Grafana dashboard's panels query (`ray_rayrep_*`, as Ray's agent names them)."""
    return {name for panel in dashboard()["panels"] for target in panel.get("targets", [])
            for name in re.findall(r"\b(ray_rayrep_\w+)", target["expr"])}


def test_the_grafana_dashboard_queries_only_series_rayrep_exports():
    """deploy/grafana-dashboard.json loads as Grafana reads it: every panel draws from the
    dashboard's data source and queries, every variable it uses is defined, and every
    training series it names is one a run exports (`rayrep.run.sinks`); the serving ones are
    checked against the server's own page in tests/test_serve.py, the training ones a run
    feeds in tests/test_metrics_plots.py."""
    from rayrep.run.sinks import COUNTERS, DERIVED_GAUGES, TRAIN_GAUGES

    board = dashboard()
    assert board["uid"] == "rayrepDashboard" and board["title"]
    defined = {v["name"] for v in board["templating"]["list"]}
    assert defined == {"datasource", "SessionName", "Run", "Deployment"}
    graphs = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"]) and len(graphs) >= 10
    for panel in graphs:
        assert panel["type"] == "timeseries" and panel["datasource"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert set(re.findall(r"\$(\w+)", target["expr"])) <= defined, target["expr"]
    exported = ({f"ray_rayrep_train_{name}" for name in (*TRAIN_GAUGES, *DERIVED_GAUGES)}
                | {f"ray_rayrep_train_{name}_total" for name in COUNTERS})
    training = {name for name in dashboard_series() if name.startswith("ray_rayrep_train_")}
    assert training <= exported and len(training) >= 12, training - exported
    assert any(name.startswith("ray_rayrep_serve_") for name in dashboard_series())
