"""Placement groups: which bundles each role gets, colocated or disaggregated.

`colocated`: generator i and learner rank i share bundle i of one placement group (they
take turns: generate, then train). `disaggregated`: generators and learners get placement
groups of their own. Verifiers get CPU bundles of their own. A bundle is
`{"CPU": cpus_per_bundle}` on CPU machines and `{"GPU": 1, "CPU": cpus_per_bundle}` on GPU
clusters; the same code places both.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field

from rayrep.config import Config


def free_port() -> int:
    """A TCP port that was free on this node a moment ago."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class RoleSlot:
    """Where one actor of a role runs: placement group, bundle, and its share of the bundle."""

    group: str
    bundle: int
    resources: dict = field(hash=False)


@dataclass
class Plan:
    groups: dict[str, list[dict]]
    """Placement group name -> its bundles."""
    strategies: dict[str, str]
    slots: dict[str, list[RoleSlot]]
    """Role -> one slot per actor."""
    threads: dict[str, int]
    """Role -> torch threads per actor."""
    nodes: int
    """Nodes this plan needs at least (GPU bundles per node from placement.gpus_per_node)."""

    @property
    def total(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for bundles in self.groups.values():
            for bundle in bundles:
                for key, value in bundle.items():
                    total[key] = total.get(key, 0) + value
        return total

    def describe(self) -> str:
        lines = ["placement plan:"]
        for name, bundles in self.groups.items():
            lines.append(f"  group {name} ({self.strategies[name]}): {len(bundles)} x {bundles[0]}")
        for role, slots in self.slots.items():
            groups = sorted({s.group for s in slots})
            where = ", ".join(
                f"{g}[{min(b)}..{max(b)}]" if len(b) > 1 else f"{g}[{b[0]}]"
                for g in groups
                for b in [[s.bundle for s in slots if s.group == g]]
            )
            lines.append(f"  {role}: {len(slots)} actor(s), each {slots[0].resources}, "
                         f"{self.threads[role]} thread(s), in {where}")
        lines.append(f"  total: {self.total}; nodes needed: {self.nodes}")
        return "\n".join(lines)


def generator_count(cfg: Config) -> int:
    """vLLM engines: `generator.num_workers`, or by default one per tensor-parallel group of
    the policy's GPUs (every GPU generates; colocated, that is the learners' GPUs)."""
    return cfg.generator.num_workers or max(1, cfg.learner.num_workers // cfg.generator.tensor_parallel_size)


def make_plan(cfg: Config, learners: bool = True) -> Plan:
    """The plan of a run; `learners=False` leaves the learner role out (sampling jobs).

    Engine e of tensor-parallel size T spans bundles e*T .. e*T + T - 1 of its group; its
    actor sits in the first of them (with T > 1, vLLM places its T workers in all of them).
    """
    place = cfg.placement
    gpu = place.device == "gpu"
    cpus = place.cpus_per_bundle
    bundle = {"GPU": 1, "CPU": cpus} if gpu else {"CPU": cpus}
    tp = cfg.generator.tensor_parallel_size
    learners, generators = (cfg.learner.num_workers if learners else 0), generator_count(cfg)
    groups: dict[str, list[dict]] = {}
    slots: dict[str, list[RoleSlot]] = {}
    if place.mode == "colocated":
        groups["policy"] = [dict(bundle) for _ in range(max(learners, generators * tp))]
        # Two roles share each bundle: each asks for half of it, so Ray accounts exactly.
        half = {key: value / 2 for key, value in bundle.items()}
        if learners:
            slots["learner"] = [RoleSlot("policy", i, half) for i in range(learners)]
        slots["generator"] = [RoleSlot("policy", i * tp, half) for i in range(generators)]
    else:
        if learners:
            groups["learners"] = [dict(bundle) for _ in range(learners)]
            slots["learner"] = [RoleSlot("learners", i, dict(bundle)) for i in range(learners)]
        groups["generators"] = [dict(bundle) for _ in range(generators * tp)]
        slots["generator"] = [RoleSlot("generators", i * tp, dict(bundle)) for i in range(generators)]
    if cfg.verifier.num_workers:
        groups["verifiers"] = [{"CPU": 1} for _ in range(cfg.verifier.num_workers)]
        slots["verifier"] = [RoleSlot("verifiers", i, {"CPU": 1}) for i in range(cfg.verifier.num_workers)]
    if learners and cfg.algorithm.uses_replay and cfg.replay.num_shards:
        shard = {"CPU": cfg.replay.cpus_per_shard}
        groups["replay"] = [dict(shard) for _ in range(cfg.replay.num_shards)]
        slots["replay"] = [RoleSlot("replay", i, dict(shard)) for i in range(cfg.replay.num_shards)]
    # CPU-only roles spread over the nodes: verifiers share the CPU load, shards the memory.
    strategies = {name: ("SPREAD" if name in ("verifiers", "replay") else "PACK") for name in groups}
    gpu_bundles = sum(b.get("GPU", 0) for bs in groups.values() for b in bs)
    nodes = max(1, math.ceil(gpu_bundles / place.gpus_per_node)) if gpu else 1
    # Colocated roles take turns, so each may use all of its bundle's cores.
    threads = {"learner": cpus, "generator": cpus, "verifier": 1, "replay": 1}
    return Plan(groups, strategies, slots, threads, nodes)


class Placement:
    """The placement groups of a plan, created and ready; hands out actor options per slot."""

    def __init__(self, plan: Plan, timeout_s: float = 600):
        import ray
        from ray.util.placement_group import placement_group

        self.plan = plan
        self.groups = {
            name: placement_group(bundles, strategy=plan.strategies[name], name=f"rayrep-{name}")
            for name, bundles in plan.groups.items()
        }
        ready = [group.ready() for group in self.groups.values()]
        _, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
        if pending:
            available = ray.available_resources()
            raise RuntimeError(
                f"placement groups not ready after {timeout_s:.0f} s: the plan needs {plan.total}, "
                f"the cluster has {available} available\n{plan.describe()}"
            )

    def options(self, role: str, index: int) -> dict:
        """`.options(...)` for actor `index` of `role`: its bundle and its share of it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot = self.plan.slots[role][index]
        resources = dict(slot.resources)
        return {
            "num_cpus": resources.pop("CPU", 0),
            "num_gpus": resources.pop("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[slot.group], placement_group_bundle_index=slot.bundle
            ),
        }

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups.values():
            remove_placement_group(group)
