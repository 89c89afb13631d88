"""The one supervisor of actors that die, used by every actor group whose actors hold nothing the
run cannot rebuild (generators, verifiers, replay shards).

A call whose actor died is asked again of a replacement started in the dead one's bundle,
at most `MAX_RETRIES` times per call; an error from an actor that still answers is never
retried (it is the call's own error, or an upstream actor's). A replacement must be ready
within `READY_TIMEOUT_S` (a new generator loads the policy and starts its engine in minutes
at paper scale; one not up by then will not be: its bundle is not coming back).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from rayrep.cluster.placement import death_cause

logger = logging.getLogger(__name__)

MAX_RETRIES = 3
"""How many times one call (a share of prompts, a shard's call) is asked again after the
actor serving it died; one more death and the run stops (`too_many_deaths`)."""

READY_TIMEOUT_S = 900.0
"""How long a replacement may take to be ready; then the call fails, naming the actor."""

Key = TypeVar("Key", bound=Hashable)
Refs = ray.ObjectRef | list[ray.ObjectRef]


def responds(actor) -> bool:
    """Whether `actor` (a role's actor with a `pid()` method) still answers, after any calls
    queued on it before this one."""
    try:
        ray.get(actor.pid.remote())
    except RayActorError:
        return False
    return True


def too_many_deaths(role: str, slot: int, deaths: int, work: str, error: BaseException) -> RuntimeError:
    """The error that ends the retries: `role` `slot` died `deaths` times on one `work`."""
    return RuntimeError(f"{role} {slot} died {deaths} times on one {work} (the first actor and {MAX_RETRIES} "
                        f"replacements); last cause: {death_cause(error)}")


class Supervisor:
    """The actors of one role, actor i in slot i (its bundle); `workers` is the live list."""

    def __init__(self, role: str, workers: list, start: Callable[[int], Any] | None = None,
                 ready: Callable[[int, Any], ray.ObjectRef] = lambda slot, actor: actor.pid.remote(),
                 on_replaced: Callable[[list[int]], None] | None = None, replace_all_dead: bool = False):
        """`start(slot)`: a new actor for `slot` in its bundle (None: nothing is replaced, a
        death fails the call). `ready(slot, actor)`: the call whose result says a new actor is
        ready (for a replay shard, restoring its content). `on_replaced(slots)`: after
        replacements are ready (the runtime brings new generators to the current policy).
        `replace_all_dead`: a death found replaces every actor of the role that no longer answers."""
        self.role, self.workers, self.start = role, workers, start
        self.ready, self.on_replaced, self.replace_all_dead = ready, on_replaced, replace_all_dead
        self.replaced = 0
        """Actors started anew so far."""

    def died(self, slot: int, actor) -> bool:
        """Whether a call on `actor`, serving `slot`, failed by its death: it was replaced
        already, or it no longer answers (an error of a live actor is not a death)."""
        return actor is not self.workers[slot] or not responds(actor)

    def gather(self, calls: dict[Key, int], submit: Callable[[Key, Any], Refs],
               work: Callable[[Key], str]) -> tuple[dict[Key, Any], Counter, int]:
        """Each call's result, waiting for all of them; call `key` runs on the actor of slot
        `calls[key]`, as `submit(key, actor)` (a ref, or refs of which the first is waited for
        and the others passed on). A call whose actor died is asked again of its replacement;
        returns the results, how many times each call was asked again, and how many actors
        were started anew meanwhile."""
        replaced_before = self.replaced
        results: dict[Key, Any] = {}
        retries: Counter = Counter()
        waiting: dict[ray.ObjectRef, tuple[Key, Any, list]] = {}

        def send(key: Key) -> None:
            actor = self.workers[calls[key]]
            refs = submit(key, actor)
            refs = refs if isinstance(refs, list) else [refs]
            waiting[refs[0]] = (key, actor, refs)

        for key in calls:
            send(key)
        while waiting:
            [ref], _ = ray.wait(list(waiting), num_returns=1)
            key, actor, refs = waiting.pop(ref)
            try:
                value = ray.get(ref)
            except RayActorError as error:
                retries[key] += 1
                self.recover(calls[key], actor, error, retries[key], work(key))
                send(key)
                continue
            results[key] = value if len(refs) == 1 else (value, *refs[1:])
        return results, retries, self.replaced - replaced_before

    def recover(self, slot: int, actor, error: RayActorError, retries: int, work: str) -> None:
        """After a call of `work` on `actor`, serving `slot`, failed with `error`, to be asked
        again for the `retries`-th time: `error` again unless the actor died; the end past
        `MAX_RETRIES`; else a replacement in the slot (unless another call replaced it already)."""
        if self.start is None or not self.died(slot, actor):
            raise error
        if retries > MAX_RETRIES:
            raise too_many_deaths(self.role, slot, retries, work, error) from error
        if actor is self.workers[slot]:
            self.replace(slot, error)

    def replace(self, slot: int, cause: BaseException) -> int:
        """A new actor for the dead one at `slot` (and, with `replace_all_dead`, for any other
        that no longer answers), each in its dead one's bundle, ready; returns how many."""
        dead = {slot: death_cause(cause)}
        if self.replace_all_dead:
            dead.update({i: "it no longer answers" for i, w in enumerate(self.workers)
                         if i != slot and not responds(w)})
        for index, why in sorted(dead.items()):
            logger.warning("%s %d died (%s); starting a replacement", self.role, index, why)
            ray.kill(self.workers[index], no_restart=True)  # frees the bundle, should it only seem dead
            self.workers[index] = self.start(index)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for index, why in sorted(dead.items()):
            try:
                ray.get(self.ready(index, self.workers[index]), timeout=max(0.0, deadline - time.monotonic()))
            except (GetTimeoutError, RayActorError) as error:
                for started in dead:  # none is left waiting for a bundle that may not come back
                    ray.kill(self.workers[started], no_restart=True)
                failure = (f"did not start within {READY_TIMEOUT_S:.0f} s (is its placement-group bundle gone "
                           "with its node?)" if isinstance(error, GetTimeoutError)
                           else f"failed to start: {death_cause(error)}")
                raise RuntimeError(f"{self.role} {index} died ({why}) and its replacement {failure}") from cause
        self.replaced += len(dead)
        if self.on_replaced is not None:
            self.on_replaced(sorted(dead))
        return len(dead)

    def replace_dead(self, error: BaseException) -> int:
        """After a call that reached every actor failed (a weight sync): replace those that
        no longer answer; `error` again when all answer (it was not a death)."""
        dead = [slot for slot, worker in enumerate(self.workers) if not responds(worker)]
        if not dead or self.start is None:
            raise error
        return self.replace(dead[0], error)
