"""GeneratorPool: splits a batch of prompts across W generator workers."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from rayrep.config import Config
from rayrep.placement import Placement
from rayrep.types import Rollout


@dataclass(frozen=True)
class PendingRollouts:
    """One worker's share of a generate call: which prompts, and the ref that resolves to
    their rollouts (one list per prompt) once the worker is done."""

    indices: range
    ref: ray.ObjectRef


def split_evenly(count: int, parts: int) -> list[range]:
    """Contiguous index ranges of near-equal size covering range(count)."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for part in range(parts):
        size = base + (part < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class GeneratorPool:
    def __init__(self, workers: list[ray.actor.ActorHandle]):
        self.workers = workers

    @staticmethod
    def create(cfg: Config, model_path: str, placement: Placement, version: int = 0) -> "GeneratorPool":
        from rayrep.generator.worker import RemoteGeneratorWorker

        threads = placement.plan.threads["generator"]
        tp = cfg.generator.tensor_parallel_size
        workers = []
        for i, slot in enumerate(placement.plan.slots["generator"]):
            bundles = list(range(slot.bundle, slot.bundle + tp))
            workers.append(RemoteGeneratorWorker.options(**placement.options("generator", i)).remote(
                cfg, model_path, i, threads, bundles, version))
        ray.get([w.policy_version.remote() for w in workers])  # engines up before anything else
        return GeneratorPool(workers)

    def generate(
        self, prompt_ids: list[list[int]], *, n: int | list[int], temperature: float, top_p: float, max_tokens: int,
        seeds: list[int] | None = None,
    ) -> list[PendingRollouts]:
        """Start sampling `n` rollouts per prompt (`n` may differ per prompt) across the workers;
        `seeds`: one per prompt (see `rayrep.generator.engine.sample`).

        Returns at once; each share's ref resolves to its prompts' rollouts.
        """
        counts = [n] * len(prompt_ids) if isinstance(n, int) else list(n)
        shares = []
        for worker, indices in zip(self.workers, split_evenly(len(prompt_ids), len(self.workers))):
            if len(indices):
                ref = worker.generate.remote(
                    [prompt_ids[i] for i in indices], [counts[i] for i in indices], temperature, top_p, max_tokens,
                    None if seeds is None else [seeds[i] for i in indices],
                )
                shares.append(PendingRollouts(indices, ref))
        return shares

    @staticmethod
    def gather(pending: list[PendingRollouts]) -> list[list[Rollout]]:
        """Every prompt's rollouts, in prompt order (waits for the workers)."""
        return [rollouts for part in ray.get([p.ref for p in pending]) for rollouts in part]

    def sleep(self) -> None:
        """Every engine frees its GPU memory for the learners (where the roles take turns)."""
        ray.get([worker.sleep.remote() for worker in self.workers])

    def wake_up(self) -> None:
        ray.get([worker.wake_up.remote() for worker in self.workers])
