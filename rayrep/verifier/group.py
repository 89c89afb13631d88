"""VerifierGroup: CPU actors scoring completions in parallel with math-verify.

Each VerifierWorker owns a `MathSandbox` (a child process with a hard per-item time
limit), so one hanging input costs at most `verifier.timeout_s` and never stalls a step
longer than that. Verdict statuses (ok / no_answer / timeout / error) come back with the
scores so the driver can count timeouts and errors per step. For evaluation, the group
also votes: each question's majority answer (maj@k) is judged where its answers are.

A verifier actor that dies (its process killed, its node lost) loses no work: the group
starts a new one in the same placement-group bundle and sends it the dead one's shares
again, up to `MAX_RETRIES` times per share, then fails naming the verifier and the cause.
Each call's `Verdicts.statuses` counts the replacements and the re-sent completions.

With `verifier.num_workers = 0` the group scores in-process through the same sandbox code.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from rayrep.cluster.placement import Placement
from rayrep.cluster.supervisor import Supervisor
from rayrep.config import Config
from rayrep.generator.group import PendingRollouts
from rayrep.library_output import route_library_output
from rayrep.types import Rollout
from rayrep.verifier.sandbox import MathSandbox
from rayrep.verifier.voting import maj_at_k


@dataclass
class Verdicts:
    """Correctness of each rollout, prompt by prompt; how many verdicts of each status; and,
    when asked for, whether each prompt's majority answer is correct.

    `statuses` counts verdicts by status (ok / no_answer / timeout / error) and, only when
    a verifier died during the call, the recovery: `replaced` (new verifier actors started)
    and `retried_items` (completions sent again to a verifier)."""

    correct: list[list[bool]]
    statuses: Counter
    majority: list[bool] | None = None


def _check(sandbox: MathSandbox, rollouts: list[list[Rollout]], truths: list[str], timeout_s: float,
           majority: bool) -> Verdicts:
    texts = [rollout.text for per_prompt in rollouts for rollout in per_prompt]
    flat_truths = [truth for truth, per_prompt in zip(truths, rollouts) for _ in per_prompt]
    verdicts = sandbox.verify_batch(texts, flat_truths, timeout_s)
    flat = iter(verdicts)
    correct = [[next(flat).correct for _ in per_prompt] for per_prompt in rollouts]
    votes = None
    if majority:
        votes = [
            maj_at_k([r.text for r in per_prompt], truth, timeout_s=timeout_s, sandbox=sandbox) == 1.0
            for per_prompt, truth in zip(rollouts, truths)
        ]
    return Verdicts(correct, Counter(v.status for v in verdicts), votes)


class VerifierWorker:
    # A sync actor: its methods run one at a time on the main thread, and the sandbox
    # enforces the time limit from there.
    def __init__(self, timeout_s: float):
        route_library_output()
        self.timeout_s = timeout_s
        self.sandbox = MathSandbox().start()

    def check(self, rollouts: list[list[Rollout]], truths: list[str], majority: bool) -> Verdicts:
        return _check(self.sandbox, rollouts, truths, self.timeout_s, majority)

    def pid(self) -> int:
        """The actor's process id; answering at all shows that the actor is alive."""
        return os.getpid()

    def close(self) -> None:
        self.sandbox.close()


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteVerifierWorker = ray.remote(VerifierWorker)


def _start_worker(timeout_s: float, placement: Placement | None, index: int) -> ray.actor.ActorHandle:
    """Verifier `index`, in its bundle of `placement` (or on one CPU anywhere)."""
    options = placement.options("verifier", index) if placement else {"num_cpus": 1}
    return RemoteVerifierWorker.options(**options).remote(timeout_s)


class VerifierGroup:
    def __init__(self, timeout_s: float, workers: list[ray.actor.ActorHandle] | None = None,
                 placement: Placement | None = None):
        """`workers`: VerifierWorker handles; empty or None scores in-process. `placement`:
        where worker i was started (`placement.options("verifier", i)`), so that a dead
        worker's replacement takes its bundle; None: one CPU anywhere."""
        self.timeout_s = timeout_s
        self.supervisor = Supervisor("verifier", workers or [], lambda slot: _start_worker(timeout_s, placement, slot))
        self.workers = self.supervisor.workers

    @staticmethod
    def create(cfg: Config, placement: Placement | None = None) -> "VerifierGroup":
        timeout_s = cfg.verifier.timeout_s
        workers = [_start_worker(timeout_s, placement, i) for i in range(cfg.verifier.num_workers)]
        return VerifierGroup(timeout_s, workers, placement)

    def check(self, pending: Sequence[PendingRollouts], truths: list[str], majority: bool = False) -> Verdicts:
        """Verdicts for the rollouts of `pending`, in prompt order: `checking`, given every part at once."""
        checking = self.checking(truths, majority)
        for part in pending:
            checking.send(part)
        return checking.result()

    def checking(self, truths: list[str], majority: bool = False) -> "Checking":
        """A check whose parts are sent as they arrive (`GeneratorGroup.complete`'s `on_arrival`)
        and whose verdicts are read once all are in. `truths[i]` is the ground truth of prompt
        i; `majority`: also judge each prompt's majority answer."""
        return Checking(self, truths, majority)

    def shutdown(self) -> None:
        """Closes every live worker's sandbox; a dead worker has nothing left to close."""
        for closed in [worker.close.remote() for worker in self.workers]:
            try:
                ray.get(closed)
            except RayActorError:
                pass


class Checking:
    """One check of a call's answers, part by part: each part (`send`) goes to a verifier actor
    at once, as its ref is (rollouts travel from generator to verifier through the object
    store, not through the driver), part k to verifier k mod n, so that scoring overlaps the
    sampling of the later parts; `result` waits for the verdicts.

    A part whose verifier dies goes again to that verifier's replacement (counted in
    `statuses` as `replaced` and `retried_items`); after `MAX_RETRIES` such deaths for one
    part, RuntimeError. Other errors (a part's ref that failed upstream) propagate.
    """

    def __init__(self, group: VerifierGroup, truths: list[str], majority: bool):
        self.group, self.truths, self.majority = group, truths, majority
        self.parts: list[PendingRollouts] = []
        self.sent: list[tuple[ray.actor.ActorHandle, ray.ObjectRef]] = []
        """Each part's verifier and the ref of its verdicts (for a group with actors)."""

    def send(self, part: PendingRollouts) -> None:
        self.parts.append(part)
        workers = self.group.workers
        if workers:
            self.sent.append(self._submit(len(self.parts) - 1, workers[(len(self.parts) - 1) % len(workers)]))

    def _truths(self, part: PendingRollouts) -> list[str]:
        return [self.truths[i] for i in part.indices]

    def _submit(self, key: int, worker) -> tuple[ray.actor.ActorHandle, ray.ObjectRef]:
        part = self.parts[key]
        return worker, worker.check.remote(part.ref, self._truths(part), self.majority)

    def result(self) -> Verdicts:
        """The verdicts of every part sent, in prompt order (waits for the verifiers)."""
        counts: Counter = Counter()
        if not self.group.workers:
            from rayrep.verifier.math import default_sandbox

            results = [_check(default_sandbox(), ray.get(part.ref), self._truths(part), self.group.timeout_s,
                              self.majority) for part in self.parts]
        else:
            def submit(key: int, worker) -> ray.ObjectRef:
                if worker is not self.sent[key][0]:  # its verifier died: the part again, to the replacement
                    self.sent[key] = self._submit(key, worker)
                return self.sent[key][1]

            workers = len(self.group.workers)
            by_key, retries, replaced = self.group.supervisor.gather(
                {key: key % workers for key in range(len(self.parts))}, submit,
                lambda key: f"share of {len(self.parts[key].indices)} prompt(s)")
            if replaced:
                counts["replaced"] += replaced
            for key, n in retries.items():
                counts["retried_items"] += n * sum(len(row) for row in by_key[key].correct)
            results = [by_key[key] for key in range(len(self.parts))]
        correct: dict[int, list[bool]] = {}
        majority: dict[int, bool] = {}
        statuses: Counter = Counter()
        for part, verdicts in zip(self.parts, results):
            correct.update(zip(part.indices, verdicts.correct))
            if self.majority:
                majority.update(zip(part.indices, verdicts.majority))
            statuses.update(verdicts.statuses)
        statuses.update(counts)
        order = sorted(correct)
        return Verdicts([correct[i] for i in order], statuses, [majority[i] for i in order] if self.majority else None)
