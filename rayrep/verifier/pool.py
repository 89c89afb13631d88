"""VerifierPool: CPU actors scoring completions in parallel with math-verify.

Each VerifierWorker owns a `MathSandbox` (a child process with a hard per-item time
limit), so one hanging input costs at most `verifier.timeout_s` and never stalls a step
longer than that. Verdict statuses (ok / no_answer / timeout / error) come back with the
scores so the driver can count timeouts and errors per step.

With `verifier.num_workers = 0` the pool scores in-process through the same sandbox code.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import ray

from rayrep.types import Rollout


@dataclass
class Verdicts:
    """Correctness of each rollout, group by group, and how many verdicts of each status."""

    correct: list[list[bool]]
    statuses: Counter


def _check(sandbox, groups: list[list[Rollout]], truths: list[str], timeout_s: float) -> tuple[list[list[bool]], Counter]:
    texts = [rollout.text for group in groups for rollout in group]
    flat_truths = [truth for truth, group in zip(truths, groups) for _ in group]
    verdicts = sandbox.verify_batch(texts, flat_truths, timeout_s)
    flat = iter(verdicts)
    return [[next(flat).correct for _ in group] for group in groups], Counter(v.status for v in verdicts)


class VerifierWorker:
    # A sync actor: its methods run one at a time on the main thread, and the sandbox
    # enforces the time limit from there.
    def __init__(self, timeout_s: float):
        from rayrep.verifier.math import MathSandbox

        self.timeout_s = timeout_s
        self.sandbox = MathSandbox().start()

    def check(self, groups: list[list[Rollout]], truths: list[str]) -> tuple[list[list[bool]], Counter]:
        return _check(self.sandbox, groups, truths, self.timeout_s)

    def close(self) -> None:
        self.sandbox.close()


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteVerifierWorker = ray.remote(VerifierWorker)


class VerifierPool:
    def __init__(self, timeout_s: float, workers: list | None = None):
        """`workers`: VerifierWorker handles; empty or None scores in-process."""
        self.timeout_s = timeout_s
        self.workers = workers or []

    @staticmethod
    def create(cfg, placement=None) -> "VerifierPool":
        count = cfg.verifier.num_workers
        workers = [
            RemoteVerifierWorker.options(**(placement.options("verifier", i) if placement else {"num_cpus": 1})).remote(
                cfg.verifier.timeout_s
            )
            for i in range(count)
        ]
        return VerifierPool(cfg.verifier.timeout_s, workers)

    def check(self, chunks: list, truths: list[str]) -> Verdicts:
        """Verdicts for the rollouts of `chunks` (from `GeneratorPool.generate`), in prompt order.

        `truths[i]` is the ground truth of prompt i. The chunks' refs go to the verifier
        actors as they are: rollouts travel from generator to verifier through the object
        store, not through the driver.
        """
        per_chunk = [[truths[i] for i in chunk.indices] for chunk in chunks]
        if not self.workers:
            from rayrep.verifier.math import default_sandbox

            results = [
                _check(default_sandbox(), ray.get(chunk.ref), chunk_truths, self.timeout_s)
                for chunk, chunk_truths in zip(chunks, per_chunk)
            ]
        else:
            results = ray.get([
                self.workers[i % len(self.workers)].check.remote(chunk.ref, chunk_truths)
                for i, (chunk, chunk_truths) in enumerate(zip(chunks, per_chunk))
            ])
        correct, statuses = [], Counter()
        for groups_correct, counts in results:
            correct.extend(groups_correct)
            statuses.update(counts)
        return Verdicts(correct, statuses)

    def shutdown(self) -> None:
        ray.get([worker.close.remote() for worker in self.workers])
