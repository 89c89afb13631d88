"""Cores lent by idle generators to a learner on the same CPU node (`placement.lend_idle_cores`).

With asynchronous rollouts and `placement.pin_cores`, each role has cores of its own, and the
step takes as long as the slower of the two: on a small CPU machine the learner's update on its
cores is longer than the generators' round on theirs, which then sit idle until the weight
sync. A generator offers its cores with a call queued behind its round (an actor runs its
calls in order, so the offer resolves when the round is sampled); the learner looks at its
offers between micro-batches and, once every one has resolved, runs its threads on their
cores too until the update ends. It gives them back before the weight sync, which waits for
the generators anyway, so the next round starts on cores of its own again.

The threads an update runs with then depend on when the round finished, and torch's CPU
kernels split some sums by thread: the update's numbers are equal to a loan-free update's up
to float round-off, not bit for bit. Off by default for that reason.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import ray
import torch


def offer(cores: Sequence[int] | None) -> tuple[str, list[int]]:
    """What a generator offers once idle: its node and the cores its threads are bound to
    (none where it is not bound: then it has no cores of its own to lend)."""
    return ray.get_runtime_context().get_node_id(), sorted(cores or [])


def resolved(offer_ref: ray.ObjectRef) -> tuple[str | None, list[int]]:
    """An offer's value; a generator that died before answering lends nothing (its
    replacement will be started on its cores)."""
    try:
        return ray.get(offer_ref)
    except ray.exceptions.RayError:
        return None, []


def thread_cores() -> dict[int, set[int]]:
    """Each thread of this process and the cores it may run on."""
    cores = {}
    for thread in map(int, os.listdir("/proc/self/task")):
        try:
            cores[thread] = os.sched_getaffinity(thread)
        except ProcessLookupError:  # (a thread that ended meanwhile)
            pass
    return cores


def bind_threads(cores: dict[int, set[int]], others: set[int]) -> None:
    """Bind each thread of this process to its `cores`, the threads not named there to
    `others` (torch's OpenMP threads started meanwhile)."""
    for thread in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(thread, cores.get(thread, others))
        except ProcessLookupError:
            pass


class CoreLoan:
    """A learner's loan of the cores that `offers` (refs to `offer`s) name on its node,
    taken at the first `take()` after every offer has resolved, given back at `give_back()`.
    One learner rank per node borrows (the config allows no more with the option).

    `borrowed_share()` is the share of `take()` calls that found the cores lent: how much of
    the update ran on them, in the learner's own units of work."""

    def __init__(self, offers: Sequence[ray.ObjectRef] = ()):
        self.offers = list(offers)
        self.own: set[int] | None = None
        """The cores this process's compute ran on before the loan (None: no loan taken)."""
        self.before: dict[int, set[int]] = {}
        """Each thread's cores before the loan (Ray's own threads may run on more)."""
        self.threads = 0
        """Its torch threads before the loan."""
        self.calls = self.borrowed_calls = 0

    def take(self) -> None:
        """Take the lent cores if every offer has resolved (never waits)."""
        self.calls += 1
        if self.own is not None:
            self.borrowed_calls += 1
            return
        if not self.offers:
            return
        ready, _ = ray.wait(self.offers, num_returns=len(self.offers), timeout=0)
        if len(ready) < len(self.offers):
            return
        node = ray.get_runtime_context().get_node_id()
        own = os.sched_getaffinity(0)
        lent = {core for at, cores in map(resolved, self.offers) if at == node for core in cores} - own
        self.offers = []  # looked at once: an offer that lent nothing is not asked again
        if not lent:
            return
        before = thread_cores()
        try:
            # Every thread: torch's OpenMP pool may have started threads on its own cores already,
            # and those it starts for the wider count inherit the calling thread's.
            bind_threads({thread: cores | lent for thread, cores in before.items()}, own | lent)
        except OSError:  # cores this process may not use (a cpuset narrower than the node): no loan
            bind_threads(before, own)
            return
        self.own, self.before, self.threads = own, before, torch.get_num_threads()
        torch.set_num_threads(self.threads + len(lent))
        self.borrowed_calls += 1

    def give_back(self) -> None:
        """Back to this process's own cores and threads (a no-op where nothing was taken)."""
        if self.own is not None:
            torch.set_num_threads(self.threads)
            bind_threads(self.before, self.own)
            self.own = None

    def borrowed_share(self) -> float:
        return self.borrowed_calls / self.calls if self.calls else 0.0

    def __enter__(self) -> "CoreLoan":
        return self

    def __exit__(self, *_) -> None:
        self.give_back()
