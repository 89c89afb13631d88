"""GeneratorWorker: a Ray actor owning one vLLM engine.

It samples rollouts with their behaviour log-probs and loads new weights from the learner
through the weight-sync group. On colocated GPUs it sleeps while the learners update.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import ray

from rayrep.cluster.memory import ENGINE, ENGINE_AWAKE, ENGINE_RUNTIME, KV_CACHE, RECEIVED, WEIGHTS, memory_plan
from rayrep.cluster.residency import ABSENT, DEVICE, DROPPED, HOST, Holding, Residency, ResidencyError
from rayrep.config import Config
from rayrep.heap import long_lived
from rayrep.library_output import route_library_output
from rayrep.models.adapter import is_adapter
from rayrep.sync.collective import WeightManifest
from rayrep.generator.vllm_internals import EXTENSION_CLASS
from rayrep.types import PAUSED, Answer, PartFacts, Rollout, RolloutPart


SLEEP_TAGS = {WEIGHTS: "weights", KV_CACHE: "kv_cache"}
"""What vLLM's sleep frees (level 1 keeps the weights in host memory, level 2 drops them), by
vLLM's tag, in the order a hand-over takes it back."""


class GeneratorWorker:
    def __init__(self, cfg: Config, model_path: str, worker_index: int, threads: int, bundles: list[int],
                 version: int = 0, start_engine: bool = True):
        """`start_engine=False`: the process comes up and imports vLLM, and the engine is built
        by `start_engine()` later (colocated, once the learners have set up and left the GPU)."""
        route_library_output()  # before vLLM starts: its notices go to the run's log file
        with long_lived():
            import torch

            from rayrep.cluster.placement import pinned_cores
            from rayrep.generator.engine import configure_vllm_env

        cores = pinned_cores(cfg, "generator", worker_index, threads)
        if cores is not None:  # before any thread starts; vLLM binds its OpenMP threads (by default: to every core)
            os.sched_setaffinity(0, cores)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        torch.set_num_threads(threads)
        self.cores = cores
        """The cores this engine's threads are bound to (`placement.pin_cores`), or None."""
        self.cfg = cfg
        self.version = version  # the policy version of `model_path` (a resumed run's checkpoint: its own)
        self.residency = engine_residency(cfg, worker_index)
        """Where the engine's weights and KV cache are (awake, asleep in host memory, dropped),
        per GPU of the engine: sampling and loading check it first."""
        self.half_loaded = False
        """A weight sync into this engine failed half way: its weights are no policy."""
        self.engine_args = dict(model_path=model_path, seed=cfg.seed("generator", worker_index),
                                worker_extension_cls=EXTENSION_CLASS, bundles=bundles)
        self.adapter = None
        """vLLM's request for the LoRA adapter every answer is sampled with (a LoRA run's
        latest, taken at each sync), or None: the engine's weights alone."""
        self.adapters_taken = 0
        self.adapter_dir = None
        """Where the adapters this engine receives are written (a temporary folder of its own)."""
        self.llm = None
        self.tool_format = None
        """How answers call the run's tool (`tools.name`), read from the engine's tokenizer."""
        if start_engine:
            self.start_engine()
        else:
            configure_vllm_env(cfg)
            with long_lived():  # (the import, while the learners set up: most of an engine's start on a CPU)
                import vllm  # noqa: F401
        if is_adapter(model_path):  # a LoRA run's checkpoint: its base, and this adapter on it
            self._take_adapter(model_path)

    def start_engine(self) -> int:
        """Build the engine, unless it is built; returns the policy version it samples."""
        if self.llm is None:
            from rayrep.generator.engine import make_engine
            from rayrep.models.tool_format import ToolFormat

            self.llm = make_engine(self.cfg, **self.engine_args)
            tools = self.cfg.tools
            if tools.enabled:  # (the driver checked the template before any actor started)
                self.tool_format = ToolFormat.of(self.llm.get_tokenizer(), tools.call_start, tools.call_end,
                                                 tools.max_output_chars)
            for part in ENGINE_AWAKE:
                self.residency.move(part, DEVICE)
        return self.version

    def generate_as_finished(
        self, prompt_ids: list[list[int]], n: int | list[int], temperature: float, top_p: float, max_tokens: int,
        seeds: list[int] | None, parts: int, carried: list[tuple[list[int], list[Answer]]] = (),
        quota: int | None = None, tool_workers: list | None = None,
    ) -> Iterator[PartFacts | RolloutPart]:
        """`n` rollouts of each prompt (see `rayrep.generator.engine.sample`), as the engine
        finishes them, in about `parts` parts (a Ray streaming call): each part is two objects,
        what the driver decides on (`PartFacts`: the positions of its prompts in `prompt_ids`,
        each answer's record, its length, finish reason and policy version), then the rollouts
        themselves (`RolloutPart`), which the reader passes on by reference (to the verifiers,
        the learners and the buffer shards) as soon as they exist. Partial rollouts: `carried`
        groups ((question, answers by reference): read here) continue their paused answers,
        and `quota` stops the call once that many groups are done
        (`rayrep.generator.engine.sample_as_finished`). `tool_workers`: the tool group's actors,
        which run the calls of a run whose answers call a tool (`rayrep.generator.turns`)."""
        from rayrep.generator.engine import sample_as_finished
        from rayrep.generator.turns import ActorTools, Turns

        # Asleep, vLLM's scheduler waits to be woken and the call would hang: refused instead.
        self.residency.require("sampling", WEIGHTS, KV_CACHE)
        if self.half_loaded:
            raise ResidencyError(f"{self.residency.owner}: sampling needs a whole policy, and its last weight sync "
                                 "failed half way (the runtime sends the weights again)")
        groups, lost = read_carried(carried, self.version)
        turns = None
        if self.tool_format is not None:
            turns = Turns(self.tool_format, ActorTools(tool_workers), self.cfg.tools.max_turns, self.llm.get_tokenizer())
        for positions, rollouts in sample_as_finished(self.llm, prompt_ids, n=n, temperature=temperature, top_p=top_p,
                                                      max_tokens=max_tokens, seeds=seeds, version=self.version,
                                                      parts=parts, min_tokens=self.cfg.generator.min_response_tokens,
                                                      carried=groups, quota=quota, adapter=self.adapter, turns=turns):
            # (Where each answer's arrays are, the reader fills in: the part's ref is made by this yield.)
            yield PartFacts(positions, [[Answer.sampled(None, (p, a), r) for a, r in enumerate(answers)]
                                        for p, answers in enumerate(rollouts)], lost)
            yield RolloutPart(rollouts)
            lost = 0

    def join_weight_group(self, host: str, port: int, world_size: int, first_rank: int) -> None:
        """Every worker of the engine joins: tensor-parallel rank t as group rank first_rank + t."""
        from rayrep.cluster.placement import weight_transport

        backend = self.cfg.placement.collective_backend
        self.llm.collective_rpc("rayrep_join_weight_group", args=(host, port, world_size, first_rank, backend,
                                                                  weight_transport(self.cfg), self.cfg.sync.timeout_s))

    def leave_weight_group(self) -> None:
        """Every worker of the engine leaves the group (it is rebuilt when a generator is replaced)."""
        self.llm.collective_rpc("rayrep_leave_weight_group")

    def sleep(self, keep_weights: bool = False) -> bool:
        """Free the GPU for the learners, where the roles take turns (vLLM's sleep mode; a CPU
        run that emulates GPUs makes the same calls, which vLLM's CPU worker takes as no-ops);
        returns whether the engine went to sleep. The KV cache is dropped; the weights are
        dropped too (vLLM sleep level 2) unless `keep_weights` (level 1: copied to host memory
        and back, 14 GiB each way for a 7B policy): a weight sync that follows overwrites them
        all, and wakes them itself (`receive_weights`). The engine's runtime (vLLM's runtime and
        CUDA-graph pools) goes to host memory at either level, and any wake maps it back. An
        engine already asleep, or between a sync and its KV cache's waking (its weights awake for
        the sync, which needs them), has nothing to free: False, and no call."""
        awake = self.residency.on_device(WEIGHTS) and self.residency.on_device(KV_CACHE)
        if not (self.cfg.placement.takes_turns and awake):
            return False
        self.residency.sample_device()  # the generate phase's peak, before the sleep frees it
        self.llm.sleep(level=1 if keep_weights else 2)
        self.residency.move(WEIGHTS, HOST if keep_weights else DROPPED)
        self.residency.move(KV_CACHE, DROPPED)
        self.residency.move(ENGINE_RUNTIME, HOST)
        return True

    def wake_up(self, tags: list[str] | None = None) -> tuple[str, ...]:
        """Take back what sleeps of `tags` ("weights", "kv_cache"; all when None), weights
        first; returns the tags woken. Each is woken once per sleep: the weights when new ones
        arrive (`receive_weights`), the KV cache after they are loaded. (vLLM 0.32's executor
        warns and does nothing for a tag that is not asleep, and its allocator skips memory
        already mapped: asking only for what sleeps keeps the hand-over exact.) Weights dropped
        at sleep wake only to be overwritten: asked for here, a ResidencyError."""
        parts = [part for part, tag in SLEEP_TAGS.items() if tags is None or tag in tags]
        if WEIGHTS in parts and self.residency.at(WEIGHTS) == DROPPED:
            raise ResidencyError(f"{self.residency.owner}: its weights were dropped as it slept (vLLM sleep level 2): "
                                 "only a weight sync (receive_weights) wakes them, with new weights")
        return self._wake(parts)

    def _wake(self, parts: list[str]) -> tuple[str, ...]:
        asleep = [part for part in SLEEP_TAGS if part in parts and not self.residency.on_device(part)]
        if asleep:
            self.llm.wake_up(tags=[SLEEP_TAGS[part] for part in asleep])
            for part in (*asleep, ENGINE_RUNTIME):  # (vLLM maps its runtime pools back with any tag)
                self.residency.move(part, DEVICE)
        return tuple(SLEEP_TAGS[part] for part in asleep)

    def receive_weights(self, manifest: WeightManifest, version: int) -> int:
        """Take the learners' weights as policy `version` (a LoRA run's: its adapter, the base
        weights staying as they are); returns tensors received."""
        self._wake([WEIGHTS])  # a sleeping engine's weight memory back on the GPU, then every tensor loaded into it
        self.half_loaded = True  # until every tensor arrived: a sync that failed is sent again whole
        with self.residency.working_on((RECEIVED,)):
            if manifest.adapter is not None:
                folder = self._adapter_folder(version)
                loaded = self.llm.collective_rpc("rayrep_receive_adapter", args=(manifest, folder))[0]
                self._take_adapter(folder)
            else:
                loaded = self.llm.collective_rpc("rayrep_receive_weights", args=(manifest,))[0]
        self.half_loaded = False
        self.residency.release_cache()  # (the extension empties the workers' caches on GPUs)
        # Cached prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()
        self.version = version
        return loaded

    def _adapter_folder(self, version: int) -> str:
        import tempfile
        from pathlib import Path

        if self.adapter_dir is None:
            self.adapter_dir = tempfile.mkdtemp(prefix="rayrep-adapters-")
        return str(Path(self.adapter_dir) / f"v{version}-{self.adapters_taken + 1}")

    def _take_adapter(self, folder: str) -> None:
        """Sample with the adapter at `folder` from now on. vLLM loads it with the first request
        that names it; the one before is dropped from the engine, and its folder, if this engine
        wrote it, from the disk. Each adapter taken gets a new name and serial: the engine
        keeps adapters by serial and caches prompts by name, so neither can serve an old one."""
        import shutil

        from rayrep.generator.engine import adapter_request
        from rayrep.generator.vllm_internals import remove_adapter

        self.adapters_taken += 1
        old, self.adapter = self.adapter, adapter_request(folder, f"policy-{self.adapters_taken}", self.adapters_taken)
        if old is not None:
            if self.llm is not None:
                remove_adapter(self.llm, old)
            if self.adapter_dir is not None and old.lora_path.startswith(self.adapter_dir):
                shutil.rmtree(old.lora_path, ignore_errors=True)

    def drop_adapters(self) -> None:
        """Remove the adapter folders this engine wrote (before the runtime ends it)."""
        import shutil

        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    def memory_report(self) -> Holding:
        """What this engine holds on each of its GPUs, now and at its peak since the last report."""
        return self.residency.report()

    def policy_version(self) -> int:
        return self.version

    def offer_cores(self) -> tuple[str, list[int]]:
        """This engine's node and bound cores, answered once it has done all it was asked before
        (an actor runs its calls in order): a learner may run on them until the weight sync
        (`rayrep.cluster.cores`)."""
        from rayrep.cluster.cores import offer

        return offer(self.cores)

    def pid(self) -> int:
        """The actor's process id; answering at all shows that the actor is alive."""
        return os.getpid()


def read_carried(carried: list[tuple[list[int], list[Answer]]], version: int) -> tuple[list[list[Rollout]], int]:
    """The carried groups' answers, read from the object store (each part once), and how many
    were lost: a group whose part is gone (its node lost) starts again from its question, every
    answer paused with no tokens (`PAUSED`: sampled whole by this call)."""
    from ray.exceptions import ObjectLostError

    parts: dict = {}
    for ref in {a.at: None for _, answers in carried for a in answers}:
        try:
            parts[ref] = ray.get(ref)
        except ObjectLostError:  # (its owner died, its copies are gone, it cannot be rebuilt)
            pass
    groups, lost = [], 0
    for prompt_ids, answers in carried:
        if all(a.at in parts for a in answers):
            groups.append([parts[a.at][a.key[0]][a.key[1]] for a in answers])
        else:
            lost += len(answers)
            groups.append([Rollout(prompt_ids, [], [], "", PAUSED, version) for _ in answers])
    return groups, lost


def engine_residency(cfg: Config, worker_index: int, built: bool = False) -> Residency:
    """An engine's residency: nothing on its GPU(s) until the engine is `built`, then its
    weights, KV cache and runtime."""
    import torch

    plan = memory_plan(cfg, trains=False)
    # Measured where this process drives the engine's one GPU itself (in-process, no tensor parallelism).
    measured = cfg.placement.device == "gpu" and cfg.generator.tensor_parallel_size == 1 and torch.cuda.is_available()
    return Residency(f"generator {worker_index}", ENGINE, {part: DEVICE if built else ABSENT for part in ENGINE_AWAKE},
                     plan.sizes[ENGINE] if plan else None,
                     torch.device("cuda", torch.cuda.current_device()) if measured else None,
                     engine_mapped=ENGINE_AWAKE)


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteGeneratorWorker = ray.remote(GeneratorWorker)
