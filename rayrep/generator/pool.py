"""GeneratorPool: splits a batch of prompts across W generator workers.

A generator that dies (its process killed, its node lost) loses no prompts: `complete`
starts a new one in the same placement-group bundle, gives it the current policy (through
the rebuilt weight-sync group in training; the pool's checkpoint elsewhere) and asks it
the dead one's shares again, with the same per-prompt seeds, up to `MAX_RETRIES` times per
share; then it fails naming the generator and the cause.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from rayrep.config import Config
from rayrep.cluster.placement import MAX_RETRIES, Placement, death_cause, responds, too_many_deaths
from rayrep.types import Rollout

if TYPE_CHECKING:
    from rayrep.runtime.weights import WeightSync

logger = logging.getLogger(__name__)

REPLACEMENT_READY_TIMEOUT_S = 900.0
"""A new generator loads the policy and starts its engine in minutes at paper scale; one that is
not up after this long will not be (its bundle is not coming back), and `complete` fails instead."""


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
                 placement: Placement | None = None, version: int = 0):
        """`workers`: GeneratorWorker handles, worker i started by `start_worker(cfg, model_path,
        placement, i, version)`; what a dead one's replacement is started with (without `cfg`,
        nothing is replaced)."""
        self.workers = workers
        self.cfg, self.model_path, self.placement, self.version = cfg, model_path, placement, version
        self.sync: WeightSync | None = None
        """The weight sync that feeds the engines (set by `WeightSync`); None: they keep `model_path`'s weights."""

    @staticmethod
    def create(cfg: Config, model_path: str, placement: Placement, version: int = 0) -> "GeneratorPool":
        workers = [start_worker(cfg, model_path, placement, i, version)
                   for i in range(len(placement.plan.slots["generator"]))]
        ray.get([w.policy_version.remote() for w in workers])  # engines up before anything else
        return GeneratorPool(workers, cfg, model_path, placement, version)

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

        A share whose generator died is asked again of that generator's replacement (started in
        its bundle, on the current policy and version; see `replace`); with per-prompt seeds its
        answers are those the dead one would have given. `counts` (when given) gains `replaced`
        (generators started anew) and `retried_prompts` (prompts asked again). After
        `MAX_RETRIES` deaths on one share, RuntimeError; any other error propagates.
        """
        counts = Counter() if counts is None else counts
        done = list(pending)
        results: list[list[list[Rollout]]] = [[] for _ in done]
        retries = [0] * len(done)
        waiting = {share.ref: position for position, share in enumerate(done)}
        while waiting:
            [ref], _ = ray.wait(list(waiting), num_returns=1)
            position = waiting.pop(ref)
            share = done[position]
            try:
                results[position] = ray.get(ref)
            except RayActorError as error:
                if share.request is None or self.cfg is None:
                    raise
                slot = share.request.generator
                current = share.worker is self.workers[slot]
                if current and responds(share.worker):
                    raise  # the generator is fine: not its death (nothing to replace)
                retries[position] += 1
                if retries[position] > MAX_RETRIES:
                    raise too_many_deaths("generator", slot, retries[position],
                                          f"share of {len(share.indices)} prompt(s)", error) from error
                if current:  # not yet replaced (an earlier share, or call, may have found it dead)
                    counts["replaced"] += self.replace(slot, error)
                done[position] = self._send(share.indices, share.request)
                waiting[done[position].ref] = position
                counts["retried_prompts"] += len(share.indices)
        return done, [rollouts for part in results for rollouts in part]

    @staticmethod
    def gather(pending: list[PendingRollouts]) -> list[list[Rollout]]:
        """Every prompt's rollouts, in prompt order (waits for the workers)."""
        return [rollouts for part in ray.get([p.ref for p in pending]) for rollouts in part]

    def replace(self, slot: int, cause: BaseException) -> int:
        """A new generator for the dead one at `slot`, and for any other that no longer answers
        (asking waits for the live ones' calls in flight), each in its dead one's bundle, on
        the current weights and policy version: with a weight sync, the group is rebuilt with
        them and the learners' weights are sent again; without one, the pool's checkpoint is
        the current policy. Returns how many were started."""
        dead = {slot: death_cause(cause)}
        dead.update({i: "it no longer answers" for i, w in enumerate(self.workers) if i != slot and not responds(w)})
        version = self.sync.version if self.sync is not None else self.version
        for index, why in sorted(dead.items()):
            logger.warning("generator %d died (%s); starting a replacement", index, why)
            ray.kill(self.workers[index], no_restart=True)  # frees the bundle, should it only seem dead
            self.workers[index] = start_worker(self.cfg, self.model_path, self.placement, index, version)
        deadline = time.monotonic() + REPLACEMENT_READY_TIMEOUT_S
        for index, why in sorted(dead.items()):
            try:
                ray.get(self.workers[index].policy_version.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except (GetTimeoutError, RayActorError) as error:
                for started in dead:  # the others too: none is left waiting for a bundle that may not come back
                    ray.kill(self.workers[started], no_restart=True)
                failure = (f"did not start within {REPLACEMENT_READY_TIMEOUT_S:.0f} s (is its placement-group "
                           "bundle gone with its node?)" if isinstance(error, GetTimeoutError)
                           else f"failed to start: {death_cause(error)}")
                raise RuntimeError(f"generator {index} died ({why}) and its replacement {failure}") from cause
        if self.sync is not None:
            self.sync.rebuild()
        return len(dead)

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
