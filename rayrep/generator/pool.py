"""GeneratorPool: splits a batch of prompts across W generator workers."""

from __future__ import annotations

import ray

from dataclasses import dataclass

from rayrep.types import Rollout


@dataclass(frozen=True)
class RolloutChunk:
    """One worker's share of a generate call: which prompts, and the ref to their rollout groups."""

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
    def __init__(self, workers: list):
        self.workers = workers

    @staticmethod
    def create(cfg, model_path: str, placement) -> "GeneratorPool":
        from rayrep.generator.worker import RemoteGeneratorWorker

        threads = placement.plan.threads["generator"]
        workers = [
            RemoteGeneratorWorker.options(**placement.options("generator", i)).remote(cfg, model_path, i, threads)
            for i in range(cfg.generator.num_workers)
        ]
        ray.get([w.policy_version.remote() for w in workers])  # engines up before anything else
        return GeneratorPool(workers)

    def generate(
        self, prompt_ids: list[list[int]], *, n: int | list[int], temperature: float, top_p: float, max_tokens: int
    ) -> list[RolloutChunk]:
        """Start sampling `n` answers per prompt (`n` may differ per prompt) across the workers.

        Returns at once; each chunk's ref resolves to that chunk's list[list[Rollout]].
        """
        counts = [n] * len(prompt_ids) if isinstance(n, int) else list(n)
        chunks = []
        for worker, indices in zip(self.workers, split_evenly(len(prompt_ids), len(self.workers))):
            if len(indices):
                ref = worker.generate.remote(
                    [prompt_ids[i] for i in indices], [counts[i] for i in indices], temperature, top_p, max_tokens
                )
                chunks.append(RolloutChunk(indices, ref))
        return chunks

    @staticmethod
    def gather(chunks: list[RolloutChunk]) -> list[list[Rollout]]:
        """Rollout groups in prompt order."""
        return [group for part in ray.get([c.ref for c in chunks]) for group in part]

    def sequence_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        refs = [
            worker.sequence_logprobs.remote([prompt_ids[i] for i in chunk], [response_ids[i] for i in chunk])
            for worker, chunk in zip(self.workers, split_evenly(len(prompt_ids), len(self.workers)))
            if len(chunk)
        ]
        return [row for chunk in ray.get(refs) for row in chunk]

    def versions(self) -> list[int]:
        return ray.get([worker.policy_version.remote() for worker in self.workers])
