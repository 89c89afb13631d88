import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from rayrep.cluster.placement import Placement, PlacementError, check_fits, free_port, make_plan
from rayrep.config import ConfigError, load_preset
from rayrep.roles.system import run_plan
from rayrep.sync.weights import engine_ranks

ROOT = Path(__file__).resolve().parents[1]


def test_colocated_plan_shares_bundles_between_roles():
    cfg = load_preset("tiny-cpu").replace(**{"learner.num_workers": 2, "learner.mini_batch_prompts": 32,
                                             "generator.num_workers": 2, "verifier.num_workers": 3})
    plan = make_plan(cfg)
    assert plan.groups["policy-0"] == [{"CPU": 1}, {"CPU": 1}]
    assert [(s.group, s.bundle) for s in plan.slots["learner"]] == [("policy-0", 0), ("policy-0", 1)]
    assert [(s.group, s.bundle) for s in plan.slots["generator"]] == [("policy-0", 0), ("policy-0", 1)]
    assert plan.slots["learner"][0].resources == {"CPU": 0.5}
    assert plan.threads["learner"] == plan.threads["generator"] == 2  # the preset's: the two roles take turns
    assert len(plan.groups["verifiers"]) == 3 and plan.total == {"CPU": 2 + 3 * 0.5}


def test_the_default_plan_fits_the_2_cpus_of_ray_start_head_on_a_2_core_machine():
    for name in ("grpo", "rlep", "exgrpo"):
        cfg = load_preset("tiny-cpu").replace(**{"algorithm.name": name, "algorithm.std_normalize": name != "exgrpo"})
        assert run_plan(cfg).total["CPU"] <= 2, name


def test_every_gpu_generates_by_default():
    cfg = load_preset("qwen2.5-math-7b-rlep")
    plan = make_plan(cfg)
    assert [len(plan.groups[f"policy-{n}"]) for n in range(8)] == [8] * 8
    assert len(plan.slots["generator"]) == 64  # one engine per GPU
    wide = make_plan(cfg.replace(**{"generator.tensor_parallel_size": 2}))
    assert [(s.group, s.bundle) for s in wide.slots["generator"][:5]] == [
        ("policy-0", 0), ("policy-0", 2), ("policy-0", 4), ("policy-0", 6), ("policy-1", 0)]  # never across nodes
    assert engine_ranks(3, 2) == [[1, 2], [3, 4], [5, 6]] and engine_ranks(2, 1) == [[1], [2]]
    assert len(make_plan(cfg.replace(**{"generator.num_workers": 16})).slots["generator"]) == 16
    with pytest.raises(ConfigError, match="must divide learner.num_workers=4"):
        cfg.replace(**{"generator.tensor_parallel_size": 8, "learner.num_workers": 4})
    with pytest.raises(ConfigError, match="must divide placement.gpus_per_node=8"):
        cfg.replace(**{"generator.tensor_parallel_size": 3})
    with pytest.raises(ConfigError, match="generator.num_workers must be set"):
        cfg.replace(**{"placement.mode": "disaggregated"})
    with pytest.raises(ConfigError, match="CPU engines run on one device"):
        load_preset("tiny-cpu").replace(**{"generator.tensor_parallel_size": 2})


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_tensor_parallel_engines_ask_no_more_of_a_bundle_than_it_holds(mode, monkeypatch):
    """With T = 2 the generator actor takes no GPU (vLLM's two Ray workers take the engine's
    bundles, a GPU share each, as engine_args asks): in every bundle the learner's share plus
    the vLLM workers' shares fit the bundle's one GPU, so every worker can be scheduled."""
    from rayrep.generator.engine import engine_args

    cfg = load_preset("qwen2.5-math-7b-rlep").replace(**{
        "generator.tensor_parallel_size": 2, "placement.mode": mode,
        "generator.num_workers": 0 if mode == "colocated" else 8})
    plan = make_plan(cfg)
    for name in ("VLLM_RAY_PER_WORKER_GPUS", "VLLM_RAY_BUNDLE_INDICES"):
        monkeypatch.delenv(name, raising=False)  # engine_args sets them for vLLM (restored afterwards)
    assert engine_args(cfg, "Qwen/Qwen2.5-Math-7B", bundles=[0, 1])["distributed_executor_backend"] == "ray"
    per_worker = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", 1))
    demand = {}
    for role in ("learner", "generator"):
        for slot in plan.slots[role]:
            demand[slot.group, slot.bundle] = demand.get((slot.group, slot.bundle), 0) + slot.resources.get("GPU", 0)
    for slot in plan.slots["generator"]:
        assert "GPU" not in slot.resources and slot.resources["CPU"] > 0
        for bundle in (slot.bundle, slot.bundle + 1):  # vLLM's TP workers, one per bundle of the engine
            demand[slot.group, bundle] = demand.get((slot.group, bundle), 0) + per_worker
    assert demand and all(plan.groups[group][bundle]["GPU"] >= used for (group, bundle), used in demand.items())
    assert max(demand.values()) == 1  # each GPU fully used: the learner's half and a worker's half, or a worker
    untouched = make_plan(load_preset("qwen2.5-math-7b-rlep"))  # T = 1: the actor is the engine, with its share
    assert {s.resources["GPU"] for s in untouched.slots["generator"]} == {0.5}


@pytest.mark.parametrize(("preset", "nodes"), [("qwen2.5-math-7b-exgrpo", 1), ("qwen2.5-math-7b-rlep", 8)])
def test_gpu_plans_keep_a_nodes_learner_ranks_together(preset, nodes):
    """1 x 8 and 8 x 8: each GPU group is one node (STRICT_PACK, at most 8 GPUs), learner
    ranks 8n .. 8n + 7 on node n, CPU roles on CPU nodes, the totals the preset's."""
    cfg = load_preset(preset)
    plan = run_plan(cfg)
    gpu_groups = [name for name in plan.groups if name.startswith("policy-")]
    assert len(gpu_groups) == plan.nodes == nodes
    for name in gpu_groups:
        assert plan.strategies[name] == "STRICT_PACK" and sum(b["GPU"] for b in plan.groups[name]) <= 8
    for rank, slot in enumerate(plan.slots["learner"]):
        assert (slot.group, slot.bundle) == (f"policy-{rank // 8}", rank % 8)
    for role in ("verifier", "replay"):
        assert all(s.resources.get("rayrep_cpu_node") and "GPU" not in s.resources for s in plan.slots[role])
    assert plan.total["GPU"] == cfg.learner.num_workers
    assert plan.total["CPU"] == pytest.approx(cfg.learner.num_workers * cfg.placement.cpus_per_bundle
                                              + cfg.verifier.num_workers + 0.25 * cfg.replay.num_shards)


def test_disaggregated_gpu_plan_counts_nodes():
    cfg = load_preset("qwen2.5-math-7b-rlep").replace(**{"placement.mode": "disaggregated", "generator.num_workers": 16})
    plan = make_plan(cfg)
    assert sum(len(plan.groups[f"learners-{n}"]) for n in range(8)) == 64
    assert sum(len(plan.groups[f"generators-{n}"]) for n in range(2)) == 16
    assert plan.slots["generator"][3].resources == {"GPU": 1, "CPU": 1}
    assert plan.nodes == 10  # 80 GPUs at 8 per node


def test_dry_run_prints_the_8_by_8_plan_without_starting_ray():
    # RAY_ADDRESS names a port that nothing listens on: a dry run that started or joined a Ray
    # cluster would fail there (or time out).
    out = subprocess.run(
        [sys.executable, "jobs/grpo.py", "--dry-run", "--preset", "qwen2.5-math-7b-rlep"],
        capture_output=True, text=True, check=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{free_port()}"),
    ).stdout
    assert "groups policy-0..7 (one node each): 8 x {'GPU': 1, 'CPU': 1}" in out
    assert "learner: 64 actor(s), each {'GPU': 0.5, 'CPU': 0.5}" in out
    assert "generator: 64 actor(s), each {'GPU': 0.5, 'CPU': 0.5}" in out
    assert "GPU nodes needed: 8" in out


def test_placement_groups_pin_actors_to_their_bundles(ray_cluster):
    cfg = load_preset("tiny-cpu")
    placement = Placement(make_plan(cfg))
    try:
        @ray.remote
        def where():
            return ray.get_runtime_context().get_placement_group_id()

        options = placement.options("learner", 0)
        assert options["num_cpus"] == 0.5
        group_id = ray.get(where.options(**options).remote())
        assert group_id == placement.groups["policy-0"].id.hex()
    finally:
        placement.remove()


def test_every_actor_of_a_run_starts_with_the_run_environment(ray_cluster, tmp_path):
    """The environment a placement hands out reaches the actors (through their runtime_env):
    on a GPU run one NCCL environment for all (`NCCL_CUMEM_ENABLE` explicit, the driver's
    `NCCL_*` passed on) and, on every run, the run's library log."""
    import os

    from rayrep.library_output import LIBRARY_LOG_ENV
    from rayrep.roles.system import actor_environment
    from rayrep.sync.collective import nccl_environment

    assert nccl_environment({"NCCL_DEBUG": "WARN", "PATH": "/bin"}) == {"NCCL_CUMEM_ENABLE": "0", "NCCL_DEBUG": "WARN"}
    assert nccl_environment({"NCCL_CUMEM_ENABLE": "1"}) == {"NCCL_CUMEM_ENABLE": "1"}  # the driver's own choice
    cfg = load_preset("tiny-cpu")
    assert actor_environment(cfg, tmp_path) == {LIBRARY_LOG_ENV: str(tmp_path.resolve() / "libraries.log")}
    gpu = actor_environment(load_preset("qwen2.5-math-7b-rlep"), tmp_path)
    assert gpu["NCCL_CUMEM_ENABLE"] == "0" and gpu[LIBRARY_LOG_ENV].endswith("libraries.log")

    placement = Placement(make_plan(cfg), actor_env={"NCCL_CUMEM_ENABLE": "0", "RAYREP_PROBE": "here"})
    try:
        @ray.remote
        class Probe:
            def env(self, names):
                return {name: os.environ.get(name) for name in names}

        for role in ("learner", "generator", "verifier"):
            probe = Probe.options(**placement.options(role, 0)).remote()
            assert ray.get(probe.env.remote(["NCCL_CUMEM_ENABLE", "RAYREP_PROBE"])) == {
                "NCCL_CUMEM_ENABLE": "0", "RAYREP_PROBE": "here"}
            ray.kill(probe)
    finally:
        placement.remove()


def test_an_impossible_plan_is_refused_at_once_naming_what_is_missing(ray_cluster):
    """The test cluster (4 CPUs, no GPU, no autoscaler) cannot grow: no waiting."""
    gpu = make_plan(load_preset("tiny-cpu").replace(**{"placement.device": "gpu"}))
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"cannot grow to hold, the plan: missing GPU 1 \(the cluster has 0\)"):
        check_fits(gpu)
    wide = make_plan(load_preset("tiny-cpu").replace(**{"placement.cpus_per_bundle": 8}))
    with pytest.raises(PlacementError, match=r"CPU 8.5 \(the cluster has 4\).*group policy-0: \{'CPU': 8\} on one node"):
        Placement(wide)
    assert time.monotonic() - start < 30  # at once, not after a timeout (generous: a loaded machine)


def test_a_growing_cluster_is_waited_for_with_progress_then_given_up(ray_cluster):
    """Told the cluster can grow, a plan it cannot hold now waits, saying what is pending,
    then gives up after the timeout with the same message (nothing left behind)."""
    lines = []
    plan = make_plan(load_preset("tiny-cpu").replace(**{"placement.cpus_per_bundle": 8}))
    with pytest.raises(PlacementError, match="placement groups not ready after 4 s .*policy-0"):
        Placement(plan, timeout_s=4, can_grow="yes", log=lines.append)
    assert lines and all(line.startswith("waiting for the cluster: policy-0") for line in lines)
    assert "'CPU': 8" in lines[0] or "CPU': 8" in lines[0]
    deadline = time.monotonic() + 30  # its placement groups were removed (Ray frees them asynchronously)
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 4


@pytest.mark.slow  # a job process that starts Ray
def test_a_gpu_job_on_a_cpu_machine_fails_within_seconds(tmp_path):
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "jobs" / "grpo.py"), "--placement.device", "gpu",
                           "--logging.out_dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "missing GPU 1 (the cluster has 0)" in done.stderr
    assert time.monotonic() - start < 120  # it used to wait 600 s
