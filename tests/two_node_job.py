"""The job of tests/test_two_nodes.py, run as its own driver process (a fresh interpreter:
Ray cannot start actors on a second cluster from a process that already ran one).

    python tests/two_node_job.py ADDRESS TINY_POLICY

Places the learner and the generator (disaggregated, 2-CPU bundles) on the cluster at
ADDRESS, syncs weights after one update, and prints their node ids and the largest gap
between the generator's behaviour log-probs and the learner's weights' log-probs.
"""

import sys

import ray

from rayrep.cluster.placement import Placement, make_plan
from rayrep.config import load_preset
from rayrep.generator.group import GeneratorGroup
from rayrep.learner.group import LearnerGroup
from rayrep.sync.weights import WeightSync
from rayrep.types import LossSpec
from test_learner_and_sync import full_state, logprob_gap, model_with, synthetic_batch


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def main(address: str, tiny_policy: str) -> None:
    ray.init(address=address, log_to_driver=False)
    cfg = load_preset("tiny-cpu").replace(**{
        "placement.mode": "disaggregated", "placement.cpus_per_bundle": 2, "placement.threads": 1,
        "generator.num_workers": 1, "learner.num_workers": 1, "verifier.num_workers": 1,
        "learner.lr": 1e-3, "learner.warmup_steps": 0,
    })
    placement = Placement(make_plan(cfg))
    learners = LearnerGroup(cfg, tiny_policy, placement)
    generators = GeneratorGroup.create(cfg, tiny_policy, placement)
    try:
        sync = WeightSync(cfg, learners, generators)
        learners.update(synthetic_batch(), LossSpec())
        sync.push()
        trained = model_with(tiny_policy, full_state(learners))
        (rollouts,) = generators.gather(generators.generate([[5, 6, 7, 8, 9]], n=3, temperature=1.0, top_p=1.0,
                                                            max_tokens=16))
        print("learner_node", node_of(learners.workers[0]))
        print("generator_node", node_of(generators.workers[0]))
        print("gap", logprob_gap(trained, rollouts))
    finally:
        for worker in generators.workers:
            ray.kill(worker)
        learners.shutdown()
        placement.remove()
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
