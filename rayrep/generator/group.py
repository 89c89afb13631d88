"""GeneratorGroup: splits a batch of prompts across W generator workers, whose answers
arrive in parts as their engines finish them (so that the verifiers score a part while the
rest is sampled).

A generator that dies (its process killed, its node lost) loses no prompts: `complete`
has the supervisor (`rayrep.cluster.supervisor`) start a new one in the same placement-group
bundle, brought to the current policy by whoever holds it (`on_replaced`: the runtime,
through the rebuilt weight sync; without one, the group's checkpoint is the policy), and
asks it the dead one's prompts whose answers had not arrived, with the same per-prompt seeds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import ray
from ray.exceptions import RayActorError

from rayrep.cluster.placement import Placement
from rayrep.cluster.supervisor import Supervisor
from rayrep.config import Config
from rayrep.types import PAUSED, Answer, PartFacts, Rollout


@dataclass(frozen=True)
class ShareRequest:
    """What one generator was asked for its share of a generate call: enough to ask again."""

    generator: int
    """The generator's index in the group (its placement slot)."""
    prompt_ids: list[list[int]]
    counts: list[int]
    temperature: float
    top_p: float
    max_tokens: int
    seeds: list[int] | None
    """One per prompt, then one per carried group."""
    parts: int
    """How many parts its answers arrive in (`generator.answer_parts`)."""
    carried: tuple[tuple[list[int], tuple[Answer, ...]], ...] = ()
    """Groups with paused answers to continue (partial rollouts), after the prompts: each
    (its question's token ids, its answers)."""
    quota: int | None = None
    """Stop once this many groups are done (partial rollouts)."""

    def subset(self, positions: Sequence[int], done: int = 0) -> "ShareRequest":
        """The same request for the groups at `positions` (ascending) of this one (each with its
        seed), `done` of its quota's groups already answered."""
        fresh = len(self.prompt_ids)
        return replace(self, prompt_ids=[self.prompt_ids[p] for p in positions if p < fresh],
                       counts=[self.counts[p] for p in positions if p < fresh],
                       carried=tuple(self.carried[p - fresh] for p in positions if p >= fresh),
                       seeds=None if self.seeds is None else [self.seeds[p] for p in positions],
                       quota=None if self.quota is None else max(1, self.quota - done))


@dataclass(frozen=True)
class Share:
    """One generator's share of a generate call, being sampled: which prompts of the call,
    what was asked of which actor, and the stream its answers arrive on (`complete` reads it)."""

    indices: Sequence[int]
    request: ShareRequest
    worker: ray.actor.ActorHandle
    stream: ray.ObjectRefGenerator
    retries: int = 0
    """How many times these prompts were asked again after a generator died."""


@dataclass(frozen=True)
class PendingRollouts:
    """Answers that exist: the ref resolves to the rollouts of the call's prompts `indices`
    (one list per prompt), for the verifiers to read without the driver passing them on."""

    indices: Sequence[int]
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


class GeneratorGroup:
    def __init__(self, workers: list[ray.actor.ActorHandle], cfg: Config | None = None, model_path: str | None = None,
                 placement: Placement | None = None, version: int = 0,
                 on_replaced: Callable[[list[int]], None] | None = None):
        """`workers`: GeneratorWorker handles, worker i started by `start_worker(cfg, model_path,
        placement, i, version)`, as a dead one's replacement is (without `cfg`, nothing is
        replaced). `on_replaced(slots)`: brings replacements to the current policy."""
        self.checkpoint_version = version
        """The policy version of the checkpoint the engines load (a replacement's too, until the
        runtime brings it to the current policy: `rayrep.roles.system.Runtime.version`)."""
        start = (lambda slot: start_worker(cfg, model_path, placement, slot, version)) if cfg is not None else None
        self.supervisor = Supervisor("generator", workers, start,
                                     ready=lambda slot, worker: worker.policy_version.remote(),
                                     on_replaced=on_replaced, replace_all_dead=True)
        self.workers = self.supervisor.workers
        self.tool_workers: list | None = None
        """The tool group's live actors, whose calls the engines make (a run whose answers call
        a tool: `rayrep.verifier.tools.ToolGroup`), or None."""

    @staticmethod
    def create(cfg: Config, model_path: str, placement: Placement, version: int = 0,
               on_replaced: Callable[[list[int]], None] | None = None) -> "GeneratorGroup":
        """The group, its engines up."""
        group = GeneratorGroup.start(cfg, model_path, placement, version, on_replaced)
        group.wait_until_idle()
        return group

    @staticmethod
    def start(cfg: Config, model_path: str, placement: Placement, version: int = 0,
              on_replaced: Callable[[list[int]], None] | None = None, engines: bool = True) -> "GeneratorGroup":
        """The group, its engines starting: other roles may set up meanwhile (`wait_until_idle`).
        `engines=False`: the workers come up without their engines, built by `start_engines`."""
        workers = [start_worker(cfg, model_path, placement, i, version, engines)
                   for i in range(len(placement.plan.slots["generator"]))]
        return GeneratorGroup(workers, cfg, model_path, placement, version, on_replaced)

    def start_engines(self) -> None:
        """Every engine built (those a group started without them)."""
        ray.get([w.start_engine.remote() for w in self.workers])

    def wait_until_idle(self) -> None:
        """Until every engine has done all it was asked before (an actor runs its calls in
        order): built (an engine that cannot start raises here, not in a step), or done
        sampling the rounds started ahead (asynchronous rollouts) before a weight sync."""
        ray.get([w.policy_version.remote() for w in self.workers])

    def offer_cores(self) -> list[ray.ObjectRef]:
        """Each engine's offer of its cores, resolving once it has sampled all it was asked
        (`placement.lend_idle_cores`, `rayrep.cluster.cores`)."""
        return [w.offer_cores.remote() for w in self.workers]

    def generate(
        self, prompt_ids: list[list[int]], *, n: int | list[int], temperature: float, top_p: float, max_tokens: int,
        seeds: list[int] | None = None, parts: int = 1,
        carried: Sequence[tuple[list[int], Sequence[Answer]]] = (),
        quota: int | None = None,
    ) -> list[Share]:
        """Start sampling `n` rollouts per prompt (`n` may differ per prompt) across the workers;
        `seeds`: one per prompt (see `rayrep.generator.engine.sample`). Each worker's answers
        arrive in about `parts` parts, as its engine finishes them.

        Partial rollouts: `carried` groups ((question's token ids, answers): the call's groups
        after the prompts, each with a seed after theirs) continue their `PAUSED` answers (a
        group whose tokens were lost with their node starts again from its question, counted
        by `complete` as `lost_carried_answers`), and the engines stop once `quota`
        groups are done (split between them as the groups are) and every carried one; the
        groups they stopped arrive last, with `PAUSED` answers
        (`rayrep.generator.engine.sample_as_finished`).

        Returns at once; `complete` reads the shares' answers as they arrive.
        """
        counts = [n] * len(prompt_ids) if isinstance(n, int) else list(n)
        fresh, workers = len(prompt_ids), len(self.workers)
        # Each engine its share of the prompts and of the carried groups (which it must finish).
        ranges = [indices for indices in
                  (a if not b else [*a, *(fresh + c for c in b)]
                   for a, b in zip(split_evenly(fresh, workers), split_evenly(len(carried), workers)))
                  if len(indices)]
        quotas = split_evenly(quota, len(ranges)) if quota is not None else [None] * len(ranges)
        shares = []
        for slot, (indices, share_quota) in enumerate(zip(ranges, quotas)):
            request = ShareRequest(
                slot, [prompt_ids[i] for i in indices if i < fresh], [counts[i] for i in indices if i < fresh],
                temperature, top_p, max_tokens, None if seeds is None else [seeds[i] for i in indices], parts,
                tuple((list(carried[i - fresh][0]), tuple(carried[i - fresh][1])) for i in indices if i >= fresh),
                None if share_quota is None else max(1, len(share_quota)),
            )
            shares.append(self._send(indices, request))
        return shares

    def _send(self, indices: Sequence[int], request: ShareRequest, retries: int = 0) -> Share:
        worker = self.workers[request.generator]
        stream = worker.generate_as_finished.options(num_returns="streaming").remote(
            request.prompt_ids, request.counts, request.temperature, request.top_p, request.max_tokens, request.seeds,
            request.parts, list(request.carried), request.quota, self.tool_workers)
        return Share(indices, request, worker, stream, retries)

    def complete(self, shares: Sequence[Share], counts: Counter | None = None,
                 on_arrival: Callable[[PendingRollouts], None] | None = None,
                 ) -> tuple[list[PendingRollouts], list[list[Answer]]]:
        """Every prompt's rollouts, in prompt order, waiting for the workers, and the parts they
        arrived in; each part goes to `on_arrival` (the verifiers) as soon as it exists, while
        the engines sample the rest. The generators' answers come as `Answer`s, their arrays
        where the generators left them: this process reads each part's facts, never its
        arrays.

        A generator that dies mid-share loses nothing that arrived: the prompts it had not
        answered are asked again of its replacement (see the module's docstring); with
        per-prompt seeds their answers are those the dead one would have given. `counts` (when
        given) gains `replaced` (generators started anew) and `retried_prompts` (prompts asked again).
        """
        counts = Counter() if counts is None else counts
        arrived: list[PendingRollouts] = []
        by_index: dict[int, list[Answer]] = {}
        replaced_before = self.supervisor.replaced

        def take(part: PendingRollouts, answers: list[list[Answer]]) -> None:
            paused = any(a.finish_reason == PAUSED for own in answers for a in own)
            if on_arrival is not None and not paused:  # (an answer not finished has nothing to check)
                on_arrival(part)
            arrived.append(part)
            by_index.update(zip(part.indices, answers))

        live: dict[ray.ObjectRefGenerator, tuple[Share, list[int]]] = {share.stream: (share, []) for share in shares}
        while live:
            [stream], _ = ray.wait(list(live), num_returns=1)
            share, answered = live[stream]
            try:
                facts: PartFacts = ray.get(next(stream))
                ref = next(stream)  # (yielded right after its facts; left where it is)
            except StopIteration:
                del live[stream]
                continue
            except RayActorError as error:
                del live[stream]
                retries = share.retries + 1
                self.supervisor.recover(share.request.generator, share.worker, error, retries,
                                        f"share of {len(share.indices)} prompt(s)")
                done = set(answered)
                rest = [p for p in range(len(share.indices)) if p not in done]
                retry = self._send([share.indices[p] for p in rest], share.request.subset(rest, len(done)), retries)
                live[retry.stream] = (retry, [])
                counts["retried_prompts"] += len(rest)
                continue
            answered.extend(facts.positions)
            if facts.lost_answers:
                counts["lost_carried_answers"] += facts.lost_answers
            answers = [[a._replace(at=ref) for a in own] for own in facts.answers]
            take(PendingRollouts([share.indices[p] for p in facts.positions], ref), answers)
        if self.supervisor.replaced > replaced_before:
            counts["replaced"] += self.supervisor.replaced - replaced_before
        return arrived, [by_index[i] for i in range(len(by_index))]

    def gather(self, shares: Sequence[Share]) -> list[list[Rollout]]:
        """Every prompt's rollouts themselves, in prompt order (waits for the workers)."""
        return self.read(self.complete(shares)[0])

    @staticmethod
    def read(arrived: Sequence[PendingRollouts]) -> list[list[Rollout]]:
        """The rollouts of parts that arrived (`complete`), in prompt order, their arrays read
        into this process: for tools that write them (the experience pool's collection)."""
        by_index: dict[int, list[Rollout]] = {}
        for part, rollouts in zip(arrived, ray.get([part.ref for part in arrived])):
            by_index.update(zip(part.indices, rollouts))
        return [list(by_index[i]) for i in range(len(by_index))]

    def sleep(self, keep_weights: bool = False) -> None:
        """Every engine frees its GPU memory for the learners (where the roles take turns),
        its weights kept in host memory only if `keep_weights` (see `GeneratorWorker.sleep`)."""
        self._every_engine(lambda worker: worker.sleep.remote(keep_weights))

    def wake_up(self) -> None:
        """Every engine takes back what sleeps of its memory."""
        self._every_engine(lambda worker: worker.wake_up.remote())

    def _every_engine(self, call: Callable) -> None:
        """`call` on every engine; an engine that died is replaced (and brought to the policy,
        `on_replaced`), then every engine is asked again: a hand-over is idempotent, so the
        ones that had done it do nothing."""
        try:
            ray.get([call(worker) for worker in self.workers])
        except RayActorError as error:
            self.supervisor.replace_dead(error)
            ray.get([call(worker) for worker in self.workers])

    def memory_reports(self) -> list[ray.ObjectRef]:
        """Refs to every engine's `Holding` (what it held on each of its GPUs since its last report)."""
        return [worker.memory_report.remote() for worker in self.workers]


def start_worker(cfg: Config, model_path: str, placement: Placement, index: int, version: int,
                 engine: bool = True) -> ray.actor.ActorHandle:
    """Generator `index` in its bundles of `placement`, loading `model_path` as policy version
    `version` (`engine=False`: once asked to, `GeneratorWorker.start_engine`)."""
    from rayrep.generator.worker import RemoteGeneratorWorker

    threads = placement.plan.threads["generator"]
    slot = placement.plan.slots["generator"][index]
    bundles = list(range(slot.bundle, slot.bundle + cfg.generator.tensor_parallel_size))
    return RemoteGeneratorWorker.options(**placement.options("generator", index)).remote(
        cfg, model_path, index, threads, bundles, version, engine)
