"""The running system: placement groups and the actors of every role, started and stopped together.

Roles: generators (vLLM), verifiers (math-verify), learners (FSDP2 / DeepSpeed), the
weight sync between them, and, for the replay methods, the replay buffer's shards.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError

from rayrep.algos.registry import algorithm_class
from rayrep.buffer.replay import ReplayStore, open_replay_store, store_kind
from rayrep.cluster.memory import DeviceLedger, RunPhase, check_memory, ledger_gpus, memory_plan
from rayrep.cluster.placement import Placement, Plan, make_plan
from rayrep.config import Config
from rayrep.generator.engine import check_vllm_version
from rayrep.generator.group import GeneratorGroup
from rayrep.learner.group import LearnerGroup
from rayrep.library_output import library_log_env
from rayrep.models import check_context
from rayrep.roles.turns import OwnDevices, SharedGpus
from rayrep.sync.weights import WeightSync
from rayrep.sync.collective import nccl_environment
from rayrep.verifier.group import VerifierGroup
from rayrep.verifier.tools import ToolGroup


def connect_ray(plan: Plan) -> bool:
    """Join the cluster this process belongs to, or start a local one; True if we started it.

    Under `ray job submit` (RAY_ADDRESS set) the job joins the submitting cluster. Otherwise a
    local cluster starts with enough logical CPUs for the plan: roles that take turns may
    share the machine's cores.
    """
    if ray.is_initialized():
        return False
    # Ray's own notices (a local instance started, token authentication on) only at ERROR:
    # the terminal is for the run's progress. Actors' output still reaches it (log_to_driver),
    # where they do not send it to the run's log file.
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True, logging_level=logging.ERROR)
        return False
    cpus = max(os.cpu_count() or 1, math.ceil(plan.total.get("CPU", 1)))
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True, logging_level=logging.ERROR)
    return True


def run_plan(cfg: Config, train: bool = True) -> Plan:
    """The placement plan of a run (`train=False`: a sampling job's), with the replay shards
    its algorithm's store needs placed."""
    shards = store_kind(cfg).shards_to_place(cfg) if train and algorithm_class(cfg).replays else 0
    return make_plan(cfg, learners=train, replay_shards=shards)


def actor_environment(cfg: Config, log_dir: str | Path | None = None) -> dict[str, str]:
    """The environment every actor of a run starts with (through its Ray `runtime_env`):
    where its libraries' output goes (`libraries.log` in `log_dir`, default
    `logging.out_dir`) and, on GPUs, one NCCL environment for all of them
    (`rayrep.sync.collective.nccl_environment`)."""
    env = library_log_env(log_dir or cfg.logging.out_dir)
    if cfg.placement.device == "gpu":
        env.update(nccl_environment())
    return env


class Runtime:
    """Every role's actors, started together (`start`) and stopped together (`shutdown`), and
    the turns they take on shared GPUs.

    The runtime holds the policy version the generators sample, and so brings a replacement
    generator to it: the generator group's supervisor calls `bring_to_policy` once a new one
    is ready, and a generator that dies during a weight sync is replaced here.

    Colocated, a learner rank and an engine worker share each GPU and take turns
    (`placement.takes_turns`): what moves at each hand-over below is `turns`' to say
    (`rayrep.roles.turns`), in the order the memory plan's timeline gives (`rayrep.cluster.memory`).
    Where the run models its GPUs, every transition is reported to the device-memory ledger
    (`observe`), which refuses (CPU runs emulating GPUs) or logs (GPU runs) a GPU that would
    overflow or a holder beyond its plan."""

    cfg: Config
    placement: Placement
    generators: GeneratorGroup
    verifiers: VerifierGroup
    tools: ToolGroup | None
    """The actors that run the answers' tool calls (`tools.name`), else None."""
    learners: LearnerGroup | None
    sync: WeightSync | None
    buffer: ReplayStore | None
    """The replay buffer of a run whose algorithm replays (its class's `replays`), else None."""
    ledger: DeviceLedger | None
    """Each GPU as the run fills it (a run that models its GPUs), else None."""
    turns: OwnDevices
    """What moves where at each hand-over: `SharedGpus` where colocated roles take turns."""

    @staticmethod
    def start(cfg: Config, model_path: str, train: bool = True, policy_version: int = 0,
              generator_path: str | None = None, log_dir: str | Path | None = None) -> "Runtime":
        """Every role's actors; `train=False` starts generators and verifiers only (sampling jobs).
        `generator_path`: the generators' weights when they are not `model_path`'s (a resumed
        run's checkpoint), of policy version `policy_version`. The actors' library output
        goes to `libraries.log` in `log_dir` (a run's folder; default: `logging.out_dir`).

        What cannot work fails first: a vLLM of another release than the pinned one, a
        context longer than the policy's positions, a GPU plan that does not fit in memory."""
        check_vllm_version()
        check_context(cfg, model_path)
        check_memory(cfg, trains=train)
        return Runtime(cfg, model_path, train, policy_version, generator_path, log_dir)

    def __init__(self, cfg: Config, model_path: str, train: bool, policy_version: int, generator_path: str | None,
                 log_dir: str | Path | None):
        self.cfg = cfg
        plan = run_plan(cfg, train)
        self.started_ray = connect_ray(plan)
        self.placement = Placement(plan, cfg.placement.wait_timeout_s, cfg.placement.cluster_can_grow,
                                   actor_env=actor_environment(cfg, log_dir),
                                   autoscaling_config=cfg.placement.autoscaling_config)
        memory = memory_plan(cfg, trains=train, local_only=False)
        self.ledger = (DeviceLedger(memory, ledger_gpus(cfg, train), strict=cfg.placement.emulate_gpus)
                       if memory is not None else None)
        self.turns = OwnDevices()
        self.generators = self.verifiers = self.tools = self.learners = self.sync = self.buffer = None
        try:
            self._start_roles(cfg, model_path, train, policy_version, generator_path)
        except BaseException:
            self.shutdown()  # what started goes: no actor or placement group outlives a start that failed
            raise

    def _start_roles(self, cfg: Config, model_path: str, train: bool, policy_version: int,
                     generator_path: str | None) -> None:
        turns = train and cfg.placement.takes_turns
        # Colocated, the learners set up first and leave their state in host memory; the
        # engines are built after, on the GPUs they left, and take their share of each. Their
        # processes come up and import vLLM meanwhile. Elsewhere the engines are built while
        # the learners set up (on a CPU machine their imports and loads overlap).
        self.generators = GeneratorGroup.start(cfg, generator_path or model_path, self.placement, policy_version,
                                              on_replaced=self.bring_to_policy, engines=not turns)
        self.verifiers = VerifierGroup.create(cfg, self.placement)
        if cfg.tools.enabled:
            self.tools = ToolGroup(cfg, self.placement)
            self.generators.tool_workers = self.tools.workers  # (the live list: replacements show)
        if train:
            self.learners = LearnerGroup(cfg, model_path, self.placement)
        if turns:
            self.turns = SharedGpus(self.generators, self.learners, self.observe, self.keeps_engine_weights)
            self.observe(RunPhase.LEARNER_SET_UP)
            self.generators.start_engines()
        self.generators.wait_until_idle()
        self.observe(RunPhase.ENGINE_START_UP)
        if train:
            self.sync = WeightSync(cfg, self.learners, self.generators, policy_version)
            if algorithm_class(cfg).replays:
                self.buffer = open_replay_store(cfg, self.placement)

    @property
    def version(self) -> int:
        """The policy version the generators sample (the learners' is one ahead during an
        update): the weight sync's count in training, else the checkpoint's."""
        return self.sync.version if self.sync is not None else self.generators.checkpoint_version

    @property
    def keeps_engine_weights(self) -> bool:
        """Whether sleeping engines keep their weights (in host memory): a LoRA run's syncs send
        the adapter alone, so the base weights they dropped would never come back."""
        return bool(self.cfg.learner.lora_rank)

    def observe(self, phase: RunPhase) -> None:
        """The device-memory ledger's view of the transition that ends `phase` (where the run
        models its GPUs): what every live learner rank and engine held since the last one."""
        if self.ledger is None:
            return
        refs = [ref for group in (self.generators, self.learners) if group is not None for ref in group.memory_reports()]
        holdings = []
        for ref in refs:
            try:
                holdings.append(ray.get(ref))
            except RayActorError:
                pass  # a dead actor holds nothing; its replacement reports from its start
        self.ledger.observe(phase, holdings)

    def hand_over_to_learners(self) -> None:
        """Where colocated roles take turns: the engines sleep, then the learners bring their
        state back (`rayrep.roles.turns`). Elsewhere nothing moves, and no call is made."""
        self.turns.to_learners()

    def idle_core_offers(self) -> list[ray.ObjectRef]:
        """With `placement.lend_idle_cores`: the generators' offers of their cores once they
        have sampled the rounds started ahead (at once where none is), for the update to
        borrow (`rayrep.cluster.cores`); none otherwise."""
        return self.generators.offer_cores() if self.cfg.placement.lend_idle_cores else []

    def restore_learners(self, folder: str, shared: dict) -> None:
        """A resumed run's learner state, loaded where it lies (host memory while the engines
        hold shared GPUs)."""
        self.learners.load_state(folder, shared)
        self.observe(RunPhase.RESUME)

    def save_learners(self, folder: str, state: bool) -> dict | None:
        """The policy as a Hugging Face checkpoint in `folder`, and (`state`) the learners'
        checkpoint in `folder/learner`; returns the learners' shared state (None without).
        Where the roles take turns, in the engines' turn: the learners' allocator cache is
        released after it (DeepSpeed gathers each fp32 master on the GPU)."""
        self.learners.save(folder)
        shared = self.learners.save_state(str(Path(folder) / "learner")) if state else None
        self.turns.after_save()
        self.observe(RunPhase.SAVE)
        return shared

    def sync_weights(self) -> dict[str, float]:
        """The learners' weights to every generator, as the next policy version; a generator
        that died in it is replaced (`sync_generator_replaced`), and the weights sent again.
        Where the roles take turns, the optimizer state leaves the GPU first: the sync needs the
        parameters alone, and the room for the engines' weights."""
        self.observe(RunPhase.UPDATE)
        self.turns.to_sync()
        try:
            pushed = self.sync.push()
        except (RayActorError, RayTaskError) as error:
            start = time.perf_counter()
            self.turns.after_failed_sync()
            self.observe(RunPhase.SYNC)
            replaced = self.generators.supervisor.replace_dead(error)  # then `bring_to_policy` sends again
            return {**self.sync.timing(time.perf_counter() - start), "sync_generator_replaced": replaced}
        self.observe(RunPhase.SYNC)
        return pushed

    def bring_to_policy(self, replaced: list[int]) -> None:
        """New generators (`replaced`) take the current weights and version: through a rebuilt
        weight sync in training; elsewhere the group's checkpoint is the policy already. Where
        the roles take turns, the engines sleep for it (it overwrites every weight) and wake
        again if it was their turn."""
        if self.sync is None:
            return
        self.observe(RunPhase.REPLACEMENT)
        self.turns.before_rebuild()
        self.sync.rebuild()
        self.observe(RunPhase.SYNC)
        self.turns.after_replacement()

    def hand_over_to_generators(self) -> dict[str, float]:
        """After the weight sync (which woke the engines' weights): where the roles take turns,
        the learners' parameters leave the GPU and the engines take their KV cache back.
        Returns the device-memory ledger's figures since the last call (a run that models its
        GPUs: the most each phase held on a GPU, in GiB)."""
        self.turns.to_generators()
        return self.ledger.take_figures() if self.ledger is not None else {}

    def replace_dead_tools(self) -> int:
        """A new tool actor for each that died since the last round (its calls were asked again
        of another, or their answers failed); returns how many."""
        return self.tools.replace_dead() if self.tools is not None else 0

    def shutdown(self) -> None:
        if self.buffer is not None:
            self.buffer.shutdown()
        if self.tools is not None:
            self.tools.shutdown()
        if self.learners is not None:
            self.learners.shutdown()
        if self.verifiers is not None:
            self.verifiers.shutdown()
        if self.generators is not None and self.cfg.learner.lora_rank:  # (their adapter folders; a dead one's stay)
            ray.wait([w.drop_adapters.remote() for w in self.generators.workers],
                     num_returns=len(self.generators.workers), timeout=10)
        for group in (self.generators, self.verifiers, self.tools):
            for worker in group.workers if group is not None else []:
                ray.kill(worker)
        self.placement.remove()
        if self.started_ray:
            ray.shutdown()
