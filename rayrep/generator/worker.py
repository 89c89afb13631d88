"""GeneratorWorker: a Ray actor owning one vLLM engine.

It samples rollouts with their behaviour log-probs and loads new weights from the learner
through the weight-sync group. On colocated GPUs it sleeps while the learners update.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import ray

from rayrep.config import Config
from rayrep.heap import long_lived
from rayrep.library_output import route_library_output
from rayrep.sync.collective import WeightManifest
from rayrep.sync.vllm_ext import EXTENSION_CLASS
from rayrep.types import Rollout


SLEEP_TAGS = ("weights", "kv_cache")
"""What vLLM's sleep frees (level 1 keeps the weights in CPU memory, level 2 drops them), in the order
a hand-over takes it back."""


class GeneratorWorker:
    def __init__(self, cfg: Config, model_path: str, worker_index: int, threads: int, bundles: list[int],
                 version: int = 0):
        route_library_output()  # before vLLM starts: its notices go to the run's log file
        with long_lived():
            import torch

            from rayrep.cluster.placement import pinned_cores
            from rayrep.generator.engine import make_engine

        cores = pinned_cores(cfg, "generator", worker_index, threads)
        if cores is not None:  # before any thread starts; vLLM binds its OpenMP threads (by default: to every core)
            os.sched_setaffinity(0, cores)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        torch.set_num_threads(threads)
        self.cfg = cfg
        self.version = version  # the policy version of `model_path` (a resumed run's checkpoint: its own)
        self.sleeping: tuple[str, ...] = ()
        """The engine's memory that sleeps now, of `SLEEP_TAGS`, in their order."""
        self.weights_dropped = False
        """Whether the sleeping weights were dropped (sleep level 2), not kept on the CPU."""
        self.llm = make_engine(
            cfg,
            model_path,
            seed=cfg.seed("generator", worker_index),
            worker_extension_cls=EXTENSION_CLASS,
            bundles=bundles,
        )

    def generate_as_finished(
        self, prompt_ids: list[list[int]], n: int | list[int], temperature: float, top_p: float, max_tokens: int,
        seeds: list[int] | None, parts: int,
    ) -> Iterator[list[int] | list[list[Rollout]]]:
        """`n` rollouts of each prompt (see `rayrep.generator.engine.sample`), as the engine
        finishes them, in about `parts` parts (a Ray streaming call): each part is two objects,
        the positions of its prompts in `prompt_ids`, then their rollouts, so that a reader can
        pass the rollouts on (to the verifiers) as soon as they exist."""
        from rayrep.generator.engine import sample_as_finished

        for positions, rollouts in sample_as_finished(self.llm, prompt_ids, n=n, temperature=temperature, top_p=top_p,
                                                      max_tokens=max_tokens, seeds=seeds, version=self.version,
                                                      parts=parts, min_tokens=self.cfg.generator.min_response_tokens):
            yield positions
            yield rollouts

    def join_weight_group(self, host: str, port: int, world_size: int, first_rank: int) -> None:
        """Every worker of the engine joins: tensor-parallel rank t as group rank first_rank + t."""
        from rayrep.cluster.placement import weight_transport

        backend = self.cfg.placement.collective_backend
        self.llm.collective_rpc("rayrep_join_weight_group",
                                args=(host, port, world_size, first_rank, backend, weight_transport(self.cfg)))

    def leave_weight_group(self) -> None:
        """Every worker of the engine leaves the group (it is rebuilt when a generator is replaced)."""
        self.llm.collective_rpc("rayrep_leave_weight_group")

    def sleep(self, keep_weights: bool = False) -> bool:
        """Free the GPU for the learners, where the roles take turns on GPUs (elsewhere, CPU,
        nothing to free); returns whether the engine went to sleep. The KV cache is dropped;
        the weights are dropped too (vLLM sleep level 2) unless `keep_weights` (level 1:
        copied to CPU memory and back, 14 GiB each way for a 7B policy): a weight sync that
        follows overwrites them all, and wakes them itself (`receive_weights`). The engine's
        own buffers (rotary tables) vLLM keeps and restores at either level."""
        if self.cfg.placement.takes_turns and not self.sleeping:
            self.llm.sleep(level=1 if keep_weights else 2)
            self.sleeping = SLEEP_TAGS
            self.weights_dropped = not keep_weights
            return True
        return False

    def wake_up(self, tags: list[str] | None = None) -> tuple[str, ...]:
        """Take back what sleeps of `tags` ("weights", "kv_cache"; all when None), weights
        first; returns what was woken. Each tag is woken once per sleep: the weights when new
        ones arrive (`receive_weights`), the KV cache after they are loaded. (vLLM 0.32's
        executor warns and does nothing for a tag that is not asleep, and its allocator skips
        memory already mapped; asking only for what sleeps keeps the hand-over exact.)
        Dropped weights wake only to be overwritten: asked for here, ValueError."""
        if self.weights_dropped and "weights" in self.sleeping and (tags is None or "weights" in tags):
            raise ValueError("the engine's weights were dropped as it slept (vLLM sleep level 2): "
                             "only a weight sync (`receive_weights`) wakes them, with new weights")
        return self._wake(tags)

    def _wake(self, tags: list[str] | None) -> tuple[str, ...]:
        woken = tuple(tag for tag in self.sleeping if tags is None or tag in tags)
        if woken:
            self.llm.wake_up(tags=list(woken))
            self.sleeping = tuple(tag for tag in self.sleeping if tag not in woken)
        return woken

    def receive_weights(self, manifest: WeightManifest, version: int) -> int:
        self._wake(["weights"])  # a sleeping engine's weight memory back on the GPU, then every tensor loaded into it
        loaded = self.llm.collective_rpc("rayrep_receive_weights", args=(manifest,))[0]
        self.weights_dropped = False  # (only once all arrived: a sync that failed is sent again whole)
        # Cached prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()
        self.version = version
        return loaded

    def policy_version(self) -> int:
        return self.version

    def pid(self) -> int:
        """The actor's process id; answering at all shows that the actor is alive."""
        return os.getpid()


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteGeneratorWorker = ray.remote(GeneratorWorker)
