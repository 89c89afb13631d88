"""Placement groups: which bundles each role gets, on which nodes, and whether the cluster can hold them.

`colocated`: generator i and learner rank i share bundle i (they take turns: generate,
then train). `disaggregated`: generators and learners get bundles of their own. A bundle
is `{"CPU": cpus_per_bundle}` on CPU machines and `{"GPU": 1, "CPU": cpus_per_bundle}` on
GPU clusters; the same code places both.

On GPU clusters each role's bundles come in groups of one node (`gpus_per_node` bundles,
STRICT_PACK): learner ranks 8n .. 8n + 7 share node n, so a node's ranks are contiguous and
an engine's tensor-parallel GPUs never span nodes. Verifiers and replay-buffer shards get
CPU bundles of their own (SPREAD), on CPU nodes when `placement.cpu_node_resource` names
the resource those nodes advertise.

Before anything is created, `Placement` compares the plan with what the cluster has, or
(autoscaling) could have: an impossible plan fails at once, naming what is missing; a
plan that fits a grown cluster waits for it, saying what is pending, up to a timeout.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass, field

from rayrep.config import Config, InputError


class PlacementError(InputError):
    """The cluster cannot hold the plan (now, or, when it cannot grow, ever): what is missing."""


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
    """GPU nodes this plan needs (one per GPU group); CPU runs: 1."""
    transport: str = ""
    """How a weight sync reaches the engines (`weight_transport`); empty: no learners, no sync."""

    @property
    def total(self) -> dict[str, float]:
        return _sum(bundle for bundles in self.groups.values() for bundle in bundles)

    def describe(self) -> str:
        lines = ["placement plan:"]
        for names in _runs(list(self.groups)):
            bundles = self.groups[names[0]]
            where = "one node each" if self.strategies[names[0]] == "STRICT_PACK" else self.strategies[names[0]]
            label = names[0] if len(names) == 1 else f"{names[0]}..{names[-1].rsplit('-', 1)[-1]}"
            lines.append(f"  group{'s' if len(names) > 1 else ''} {label} ({where}): {len(bundles)} x {bundles[0]}")
        for role, slots in self.slots.items():
            groups = sorted({s.group for s in slots}, key=_group_order)
            spots = ", ".join(
                f"{g}[{min(b)}..{max(b)}]" if len(b) > 1 else f"{g}[{b[0]}]"
                for g in groups
                for b in [[s.bundle for s in slots if s.group == g]]
            )
            if len(groups) > 2:
                spots = f"{spots.split(', ')[0]}, ..., {spots.split(', ')[-1]}"
            lines.append(f"  {role}: {len(slots)} actor(s), each {slots[0].resources}, "
                         f"{self.threads[role]} thread(s), in {spots}")
        gpu = any("GPU" in b for bs in self.groups.values() for b in bs)
        if self.transport:
            lines.append(f"  weight sync: {describe_transport(self.transport, gpu)}")
        lines.append(f"  total: {self.total}; GPU nodes needed: {self.nodes}" if gpu else f"  total: {self.total}")
        return "\n".join(lines)


def _sum(bundles) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0) + value
    return total


def _group_order(name: str) -> tuple[str, int]:
    base, _, index = name.rpartition("-")
    return (base, int(index)) if index.isdigit() else (name, 0)


def _runs(names: list[str]) -> list[list[str]]:
    """Consecutive numbered groups of the same role and shape, for a short description."""
    runs: list[list[str]] = []
    for name in names:
        if runs and _group_order(runs[-1][-1])[0] == _group_order(name)[0] != name:
            runs[-1].append(name)
        else:
            runs.append([name])
    return runs


def pinned_cores(cfg: Config, role: str, index: int, threads: int) -> list[int] | None:
    """The cores generator or learner `index` binds its `threads` threads to with
    `placement.pin_cores` on CPU (generators first, then learners, wrapping around the
    node's cores); None: no binding asked."""
    if cfg.placement.device != "cpu" or not cfg.placement.pin_cores:
        return None
    import os

    first = (index if role == "generator" else generator_count(cfg) + index) * threads
    return sorted({(first + k) % (os.cpu_count() or 1) for k in range(threads)})


def generator_count(cfg: Config) -> int:
    """vLLM engines: `generator.num_workers`, or by default one per tensor-parallel group of
    the policy's GPUs (every GPU generates; colocated, that is the learners' GPUs)."""
    return cfg.generator.num_workers or max(1, cfg.learner.num_workers // cfg.generator.tensor_parallel_size)


def weight_transport(cfg: Config) -> str:
    """How a sync's weights reach the engines: the one place it is chosen
    (`rayrep.sync.transport`). `handles` when every engine worker shares a learner rank's
    bundle (colocated, no more engine workers than learner ranks): the rank beside each
    worker hands it the tensors, as NCCL refuses two ranks of one group on one GPU.
    Otherwise `broadcast` from learner rank 0 over a group (colocated GPU runs never get
    there: the config refuses more engine GPUs than learner GPUs)."""
    engine_workers = generator_count(cfg) * cfg.generator.tensor_parallel_size
    return "handles" if cfg.placement.mode == "colocated" and engine_workers <= cfg.learner.num_workers else "broadcast"


TRANSPORT_DESCRIPTIONS = {
    "handles": "{handles} handles: learner rank j hands engine worker j, on the same {device}, each bucket",
    "broadcast": "{backend} broadcast from learner rank 0 to every engine worker",
}
"""What each weight transport (`rayrep.sync.transport.TRANSPORTS`, by name) does, as a plan prints it."""


def describe_transport(transport: str, gpu: bool) -> str:
    return TRANSPORT_DESCRIPTIONS[transport].format(handles="CUDA IPC" if gpu else "shared-memory",
                                                    device="GPU" if gpu else "node", backend="NCCL" if gpu else "gloo")


def make_plan(cfg: Config, learners: bool = True, replay_shards: int = 0) -> Plan:
    """The plan of a run; `learners=False` leaves the learner role out (sampling jobs);
    `replay_shards`: the replay store's shards to place (`rayrep.roles.system.run_plan`
    asks the run's algorithm and store how many).

    Engine e of tensor-parallel size T spans bundles e*T .. e*T + T - 1 of its role's
    bundles; its actor sits in the first of them (with T > 1 it takes no GPU there: vLLM
    places its T workers, a GPU share each, in all of them).
    """
    place = cfg.placement
    gpu = place.device == "gpu"
    cpus = place.cpus_per_bundle
    bundle = {"GPU": 1, "CPU": cpus} if gpu else {"CPU": cpus}
    tp = cfg.generator.tensor_parallel_size
    learner_count, generators = (cfg.learner.num_workers if learners else 0), generator_count(cfg)
    groups: dict[str, list[dict]] = {}
    strategies: dict[str, str] = {}
    slots: dict[str, list[RoleSlot]] = {}

    def add_groups(name: str, count: int) -> None:
        """`count` bundles of the policy's shape: one STRICT_PACK group per node on GPUs."""
        per_group = place.gpus_per_node if gpu else max(1, count)
        for k in range(math.ceil(count / per_group)):
            groups[f"{name}-{k}"] = [dict(bundle) for _ in range(min(per_group, count - k * per_group))]
            strategies[f"{name}-{k}"] = "STRICT_PACK" if gpu else "PACK"

    def slot(name: str, index: int, resources: dict) -> RoleSlot:
        per_group = place.gpus_per_node if gpu else len(groups[f"{name}-0"])
        return RoleSlot(f"{name}-{index // per_group}", index % per_group, resources)

    def engine_actor(resources: dict) -> dict:
        """What a generator actor asks of its first bundle. With T > 1 vLLM's T Ray workers
        take the engine's GPUs, one bundle each; the actor that drives them takes none, or
        worker 0 would find its bundle's GPU taken and never be scheduled (OpenRLHF's
        vllm_engine.py does the same)."""
        return {key: value for key, value in resources.items() if key != "GPU"} if tp > 1 else resources

    if place.mode == "colocated":
        add_groups("policy", max(learner_count, generators * tp))
        # Two roles share each bundle: each asks for half of it, so Ray accounts exactly.
        half = {key: value / 2 for key, value in bundle.items()}
        if learner_count:
            slots["learner"] = [slot("policy", i, half) for i in range(learner_count)]
        slots["generator"] = [slot("policy", i * tp, engine_actor(half)) for i in range(generators)]
    else:
        if learner_count:
            add_groups("learners", learner_count)
            slots["learner"] = [slot("learners", i, dict(bundle)) for i in range(learner_count)]
        add_groups("generators", generators * tp)
        slots["generator"] = [slot("generators", i * tp, engine_actor(dict(bundle))) for i in range(generators)]
    gpu_groups = len(groups) if gpu else 0

    # CPU roles: spread over the nodes (verifiers share the CPU load, shards the memory), on
    # CPU nodes when the cluster marks them.
    marker = {place.cpu_node_resource: 0.001} if place.cpu_node_resource else {}
    cpu_roles = [("verifier", "verifiers", cfg.verifier.num_workers, cfg.verifier.cpus_per_worker)]
    if cfg.tools.enabled:
        cpu_roles.append(("tool", "tools", cfg.tools.num_workers, cfg.tools.cpus_per_worker))
    if replay_shards:
        cpu_roles.append(("replay", "replay", replay_shards, cfg.replay.cpus_per_shard))
    for role, name, count, role_cpus in cpu_roles:
        if count:
            shape = {"CPU": role_cpus, **marker}
            groups[name] = [dict(shape) for _ in range(count)]
            strategies[name] = "SPREAD"
            slots[role] = [RoleSlot(name, i, dict(shape)) for i in range(count)]
    # Colocated roles take turns, so each may use all of its bundle's cores (or `placement.threads`).
    threads = place.threads or cpus
    return Plan(groups, strategies, slots, {"learner": threads, "generator": threads, "verifier": 1, "tool": 1, "replay": 1},
                nodes=max(1, gpu_groups), transport=weight_transport(cfg) if learners else "")


class Placement:
    """The placement groups of a plan, created and ready; hands out actor options per slot."""

    def __init__(self, plan: Plan, timeout_s: float = 600, can_grow: str = "auto", log=print,
                 actor_env: dict[str, str] | None = None, autoscaling_config: str | None = None):
        """Checks the plan against the cluster first (`check_fits`), then creates the groups
        and waits for them, logging what is pending every 30 s, up to `timeout_s`.
        `actor_env`: environment variables every actor placed here starts with (the run's
        library log, its NCCL settings: `rayrep.roles.system.actor_environment`).
        `autoscaling_config`: where an autoscaler v1's config may be read (`cluster_capacity`)."""
        import ray
        from ray.util.placement_group import placement_group

        self.plan = plan
        self.actor_env = dict(actor_env or {})
        check_fits(plan, can_grow, autoscaling_config)
        self.groups = {
            name: placement_group(bundles, strategy=plan.strategies[name], name=f"rayrep-{name}")
            for name, bundles in plan.groups.items()
        }
        waiting = {group.ready(): name for name, group in self.groups.items()}
        start = time.monotonic()
        while waiting:
            left = timeout_s - (time.monotonic() - start)
            # A progress line every 30 s (sooner under a short timeout).
            ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=max(0.0, min(30.0, timeout_s / 4, left)))
            for ref in ready:
                del waiting[ref]
            if not waiting:
                break
            pending = sorted(waiting.values(), key=_group_order)
            waited = time.monotonic() - start
            if waited >= timeout_s:
                self.remove()
                raise PlacementError(
                    f"placement groups not ready after {timeout_s:.0f} s ({_names(pending)} pending): the plan needs "
                    f"{plan.total}, the cluster has {_rounded(ray.cluster_resources())} "
                    f"({_rounded(ray.available_resources())} free)\n{plan.describe()}"
                )
            log(f"waiting for the cluster: {_names(pending)} pending for {waited:.0f} s "
                f"(needs {_rounded(_sum(b for name in pending for b in plan.groups[name]))}; "
                f"free now {_rounded(ray.available_resources())}; giving up after {timeout_s:.0f} s)")

    def options(self, role: str, index: int) -> dict:
        """`.options(...)` for actor `index` of `role`: its bundle and its share of it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot = self.plan.slots[role][index]
        resources = dict(slot.resources)
        num_cpus, num_gpus = resources.pop("CPU", 0), resources.pop("GPU", 0)
        options = {
            "num_cpus": num_cpus,
            "num_gpus": num_gpus,
            "resources": resources,  # a CPU node's marker, if any
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[slot.group], placement_group_bundle_index=slot.bundle
            ),
        }
        if self.actor_env:  # merged with the job's runtime_env (its working_dir stays)
            options["runtime_env"] = {"env_vars": dict(self.actor_env)}
        return options

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups.values():
            remove_placement_group(group)


def _names(groups) -> str:
    names = sorted(groups, key=_group_order)
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, ... ({len(names)} groups)"


def _rounded(resources: dict) -> dict:
    """Ray's resource dict without its per-node and memory entries, for messages."""
    return {k: round(v, 3) for k, v in sorted(resources.items())
            if not k.startswith("node:") and k not in ("memory", "object_store_memory") and "_group_" not in k}


def cluster_capacity(can_grow: str, autoscaling_config: str | None = None
                     ) -> tuple[dict[str, float], list[dict[str, float]], bool]:
    """(the most of each resource the cluster can have, the node shapes it has or can add,
    whether it can grow). "auto": the cluster can grow when an autoscaler runs. Autoscaler
    v2 publishes its node types (Ray Train checks its worker groups against the same
    config); v1 publishes only its status, and its node types are read from the config it
    was started with (`autoscaling_config`, where the cluster launcher writes it): without
    that file the cluster is taken as it is (`placement.cluster_can_grow = "yes"` tells
    otherwise). "yes" / "no": as told."""
    import ray
    from ray._private.state import state

    nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    current = _sum(nodes)
    if can_grow != "auto":
        grows = can_grow == "yes"
        return (current if not grows else {}), nodes, grows
    config = state.get_cluster_config()
    if config is not None and len(config.node_group_configs) > 0:
        maximum = state.get_max_resources_from_cluster_config() or {}
        shapes = [dict(group.resources) for group in config.node_group_configs]
    elif (types := _node_types(autoscaling_config)) and _autoscaler_v1_runs():  # (every head runs a v1 monitor, a read-only one without a config)
        head = max(nodes, key=lambda n: "node:__internal_head__" in n, default={})
        maximum = _sum([{k: v * count for k, v in shape.items()} for shape, count in types] + [head])
        shapes = [shape for shape, _ in types]
    else:
        return current, nodes, False
    return {k: max(v, current.get(k, 0)) for k, v in {**current, **maximum}.items()}, nodes + shapes, True


def _autoscaler_v1_runs() -> bool:
    """Whether an autoscaler v1 monitor reports its status (it writes it every update)."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    return _internal_kv_initialized() and _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS) is not None


def _node_types(path: str | None) -> list[tuple[dict[str, float], int]] | None:
    """(resources, max_workers) of each worker node type of the autoscaler config at `path`
    (YAML or JSON), or None when there is none to read."""
    import os

    import yaml

    if not path or not os.path.exists(os.path.expanduser(path)):
        return None
    with open(os.path.expanduser(path)) as file:
        config = yaml.safe_load(file) or {}
    head_type = config.get("head_node_type")
    limit = config.get("max_workers")
    types = []
    for name, spec in (config.get("available_node_types") or {}).items():
        if name == head_type or "max_workers" not in spec:
            continue
        count = spec["max_workers"] if limit is None else min(spec["max_workers"], limit)
        types.append(({k: float(v) for k, v in (spec.get("resources") or {}).items()}, int(count)))
    return types


def check_fits(plan: Plan, can_grow: str = "auto", autoscaling_config: str | None = None) -> None:
    """Refuse at once a plan the cluster cannot hold: more of a resource than it has (or,
    autoscaling, could have), or a one-node group larger than any node (or node type)."""
    capacity, shapes, grows = cluster_capacity(can_grow, autoscaling_config)
    if grows and not capacity:
        return  # told it can grow, with no limits known: the placement groups will tell
    missing = []
    for resource, need in plan.total.items():
        have = capacity.get(resource, 0)
        if need > have + 1e-9:
            missing.append(f"{resource} {need:g} (the cluster {'can reach' if grows else 'has'} {have:g})")
    for name, bundles in plan.groups.items():
        needs = [_sum(bundles)] if plan.strategies[name] == "STRICT_PACK" else bundles
        for need in needs:
            if not any(all(shape.get(k, 0) >= v - 1e-9 for k, v in need.items()) for shape in shapes):
                missing.append(f"group {name}: {need} on one node, which no node{' type' if grows else ''} has")
                break
    if missing:
        raise PlacementError(
            f"this cluster {'cannot grow to hold' if grows else 'cannot hold, and cannot grow to hold,'} the plan: "
            f"missing {'; '.join(missing)}\n{plan.describe()}"
        )


# ---------------------------------------------------------------------- actors that die
# The supervisor (`rayrep.cluster.supervisor`) starts a dead actor's replacement in its bundle
# (`Placement.options`).


def death_cause(error: BaseException, limit: int = 600) -> str:
    """Ray's multi-line death report (which actor, which process, why), on one line."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
