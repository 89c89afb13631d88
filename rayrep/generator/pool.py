"""GeneratorPool: splits a batch of prompts across W generator workers.

A generator that dies (its process killed, its node lost) loses no prompts: `complete`
has the supervisor (`rayrep.cluster.supervisor`) start a new one in the same placement-group
bundle, brought to the current policy by whoever holds it (`on_replaced`: the runtime,
through the rebuilt weight sync; without one, the pool's checkpoint is the policy), and
asks it the dead one's shares again, with the same per-prompt seeds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import ray

from rayrep.cluster.placement import Placement
from rayrep.cluster.supervisor import Supervisor
from rayrep.config import Config
from rayrep.types import Rollout


@dataclass(frozen=True)
class ShareRequest:
    """What one generator was asked for its share of a generate call: enough to ask again."""

    generator: int
    """The generator's index in the pool (its placement slot)."""
    prompt_ids: list[list[int]]
    counts: list[int]
    temperature: float
    top_p: float
    max_tokens: int
    seeds: list[int] | None


@dataclass(frozen=True)
class PendingRollouts:
    """One worker's share of a generate call: which prompts, and the ref that resolves to
    their rollouts (one list per prompt) once the worker is done."""

    indices: range
    ref: ray.ObjectRef
    request: ShareRequest | None = None
    """What the share asked of which generator; None: rollouts made elsewhere (nothing to ask again)."""
    worker: ray.actor.ActorHandle | None = None
    """The actor the request went to (once its generator is replaced, the share goes to the new one)."""


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
    def __init__(self, workers: list[ray.actor.ActorHandle], cfg: Config | None = None, model_path: str | None = None,
                 placement: Placement | None = None, version: int = 0,
                 on_replaced: Callable[[list[int]], None] | None = None):
        """`workers`: GeneratorWorker handles, worker i started by `start_worker(cfg, model_path,
        placement, i, version)`, as a dead one's replacement is (without `cfg`, nothing is
        replaced). `on_replaced(slots)`: brings replacements to the current policy."""
        self.version = version
        start = (lambda slot: start_worker(cfg, model_path, placement, slot, version)) if cfg is not None else None
        self.supervisor = Supervisor("generator", workers, start,
                                     ready=lambda slot, worker: worker.policy_version.remote(),
                                     on_replaced=on_replaced, replace_all_dead=True)
        self.workers = self.supervisor.workers

    @staticmethod
    def create(cfg: Config, model_path: str, placement: Placement, version: int = 0,
               on_replaced: Callable[[list[int]], None] | None = None) -> "GeneratorPool":
        """The pool, its engines up."""
        pool = GeneratorPool.start(cfg, model_path, placement, version, on_replaced)
        pool.wait_until_up()
        return pool

    @staticmethod
    def start(cfg: Config, model_path: str, placement: Placement, version: int = 0,
              on_replaced: Callable[[list[int]], None] | None = None) -> "GeneratorPool":
        """The pool, its engines starting: other roles may set up meanwhile (`wait_until_up`)."""
        workers = [start_worker(cfg, model_path, placement, i, version)
                   for i in range(len(placement.plan.slots["generator"]))]
        return GeneratorPool(workers, cfg, model_path, placement, version, on_replaced)

    def wait_until_up(self) -> None:
        """Every engine built (an engine that cannot start raises here, not in a step)."""
        ray.get([w.policy_version.remote() for w in self.workers])

    def generate(
        self, prompt_ids: list[list[int]], *, n: int | list[int], temperature: float, top_p: float, max_tokens: int,
        seeds: list[int] | None = None,
    ) -> list[PendingRollouts]:
        """Start sampling `n` rollouts per prompt (`n` may differ per prompt) across the workers;
        `seeds`: one per prompt (see `rayrep.generator.engine.sample`).

        Returns at once; each share's ref resolves to its prompts' rollouts. A share whose
        generator may die before it is done goes through `complete` before anything reads it.
        """
        counts = [n] * len(prompt_ids) if isinstance(n, int) else list(n)
        shares = []
        for slot, indices in enumerate(split_evenly(len(prompt_ids), len(self.workers))):
            if len(indices):
                request = ShareRequest(
                    slot, [prompt_ids[i] for i in indices], [counts[i] for i in indices], temperature, top_p,
                    max_tokens, None if seeds is None else [seeds[i] for i in indices],
                )
                shares.append(self._send(indices, request))
        return shares

    def _send(self, indices: range, request: ShareRequest) -> PendingRollouts:
        worker = self.workers[request.generator]
        ref = worker.generate.remote(request.prompt_ids, request.counts, request.temperature, request.top_p,
                                     request.max_tokens, request.seeds)
        return PendingRollouts(indices, ref, request, worker)

    def complete(self, pending: list[PendingRollouts],
                 counts: Counter | None = None) -> tuple[list[PendingRollouts], list[list[Rollout]]]:
        """`pending` with every share done (waits for the workers): the same shares, in order,
        each ref resolved (for the verifiers), and every prompt's rollouts, in prompt order.

        A share whose generator died is asked again of that generator's replacement (see the
        module's docstring); with per-prompt seeds its answers are those the dead one would
        have given. `counts` (when given) gains `replaced` (generators started anew) and
        `retried_prompts` (prompts asked again).
        """
        counts = Counter() if counts is None else counts
        done = list(pending)

        def submit(position: int, worker) -> ray.ObjectRef:
            share = done[position]
            if worker is not share.worker:  # a replacement (now, or by an earlier call): the same request again
                done[position] = self._send(share.indices, share.request)
                counts["retried_prompts"] += len(share.indices)
            return done[position].ref

        results, _, replaced = self.supervisor.gather(
            {position: share.request.generator if share.request is not None else 0
             for position, share in enumerate(done)},
            submit, lambda position: f"share of {len(done[position].indices)} prompt(s)")
        if replaced:
            counts["replaced"] += replaced
        return done, [rollouts for position in range(len(done)) for rollouts in results[position]]

    @staticmethod
    def gather(pending: list[PendingRollouts]) -> list[list[Rollout]]:
        """Every prompt's rollouts, in prompt order (waits for the workers)."""
        return [rollouts for part in ray.get([p.ref for p in pending]) for rollouts in part]

    def sleep(self) -> None:
        """Every engine frees its GPU memory for the learners (where the roles take turns)."""
        ray.get([worker.sleep.remote() for worker in self.workers])

    def wake_up(self) -> None:
        ray.get([worker.wake_up.remote() for worker in self.workers])


def start_worker(cfg: Config, model_path: str, placement: Placement, index: int, version: int) -> ray.actor.ActorHandle:
    """Generator `index` in its bundles of `placement`, loading `model_path` as policy version `version`."""
    from rayrep.generator.worker import RemoteGeneratorWorker

    threads = placement.plan.threads["generator"]
    slot = placement.plan.slots["generator"][index]
    bundles = list(range(slot.bundle, slot.bundle + cfg.generator.tensor_parallel_size))
    return RemoteGeneratorWorker.options(**placement.options("generator", index)).remote(
        cfg, model_path, index, threads, bundles, version)
