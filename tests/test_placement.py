import subprocess
import sys

import pytest
import ray

from rayrep.config import ConfigError, load_preset
from rayrep.placement import Placement, make_plan
from rayrep.sync.weights import engine_ranks


def test_colocated_plan_shares_bundles_between_roles():
    cfg = load_preset("tiny-cpu").replace(**{"learner.num_workers": 2, "learner.mini_batch_prompts": 32,
                                             "generator.num_workers": 2, "verifier.num_workers": 3})
    plan = make_plan(cfg)
    assert plan.groups["policy"] == [{"CPU": 2}, {"CPU": 2}]
    assert [(s.group, s.bundle) for s in plan.slots["learner"]] == [("policy", 0), ("policy", 1)]
    assert [(s.group, s.bundle) for s in plan.slots["generator"]] == [("policy", 0), ("policy", 1)]
    assert plan.slots["learner"][0].resources == {"CPU": 1.0}
    assert len(plan.groups["verifiers"]) == 3 and plan.total == {"CPU": 7}


def test_every_gpu_generates_by_default():
    cfg = load_preset("qwen2.5-math-7b-rlep")
    plan = make_plan(cfg)
    assert len(plan.groups["policy"]) == 64
    assert [s.bundle for s in plan.slots["generator"]] == list(range(64))  # one engine per GPU
    wide = make_plan(cfg.replace(**{"generator.tensor_parallel_size": 2}))
    assert len(wide.groups["policy"]) == 64
    assert [s.bundle for s in wide.slots["generator"]] == list(range(0, 64, 2))  # engine e spans bundles 2e, 2e+1
    assert engine_ranks(3, 2) == [[1, 2], [3, 4], [5, 6]] and engine_ranks(2, 1) == [[1], [2]]
    assert len(make_plan(cfg.replace(**{"generator.num_workers": 16})).slots["generator"]) == 16
    with pytest.raises(ConfigError, match="must divide learner.num_workers=64"):
        cfg.replace(**{"generator.tensor_parallel_size": 3})
    with pytest.raises(ConfigError, match="generator.num_workers must be set"):
        cfg.replace(**{"placement.mode": "disaggregated"})
    with pytest.raises(ConfigError, match="CPU engines run on one device"):
        load_preset("tiny-cpu").replace(**{"generator.tensor_parallel_size": 2})


def test_disaggregated_gpu_plan_counts_nodes():
    cfg = load_preset("qwen2.5-math-7b-rlep").replace(**{"placement.mode": "disaggregated", "generator.num_workers": 16})
    plan = make_plan(cfg)
    assert len(plan.groups["learners"]) == 64 and len(plan.groups["generators"]) == 16
    assert plan.groups["learners"][0] == {"GPU": 1, "CPU": 1}
    assert plan.slots["generator"][3].resources == {"GPU": 1, "CPU": 1}
    assert plan.nodes == 10  # 80 GPUs at 8 per node


def test_dry_run_prints_the_plan_without_starting_ray():
    out = subprocess.run(
        [sys.executable, "jobs/grpo.py", "--dry-run", "--preset", "qwen2.5-math-7b-rlep"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    assert "group policy (PACK): 64 x {'GPU': 1, 'CPU': 1}" in out
    assert "learner: 64 actor(s), each {'GPU': 0.5, 'CPU': 0.5}" in out
    assert "generator: 64 actor(s), each {'GPU': 0.5, 'CPU': 0.5}" in out
    assert "nodes needed: 8" in out
    assert not ray.is_initialized()


def test_placement_groups_pin_actors_to_their_bundles(ray_cluster):
    cfg = load_preset("tiny-cpu").replace(**{"placement.cpus_per_bundle": 1})
    placement = Placement(make_plan(cfg))
    try:
        @ray.remote
        def where():
            return ray.get_runtime_context().get_placement_group_id()

        options = placement.options("learner", 0)
        assert options["num_cpus"] == 0.5
        group_id = ray.get(where.options(**options).remote())
        assert group_id == placement.groups["policy"].id.hex()
    finally:
        placement.remove()
