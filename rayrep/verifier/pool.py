"""VerifierPool: CPU actors scoring completions in parallel with math-verify.

Each VerifierWorker owns a `MathSandbox` (a child process with a hard per-item time
limit), so one hanging input costs at most `verifier.timeout_s` and never stalls a step
longer than that. Verdict statuses (ok / no_answer / timeout / error) come back with the
scores so the driver can count timeouts and errors per step. For evaluation, the pool
also votes: each question's majority answer (maj@k) is judged where its answers are.

With `verifier.num_workers = 0` the pool scores in-process through the same sandbox code.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import ray

from rayrep.config import Config
from rayrep.eval import maj_at_k
from rayrep.generator.pool import PendingRollouts
from rayrep.placement import Placement
from rayrep.types import Rollout
from rayrep.verifier.sandbox import MathSandbox


@dataclass
class Verdicts:
    """Correctness of each rollout, prompt by prompt; how many verdicts of each status; and,
    when asked for, whether each prompt's majority answer is correct."""

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
        self.timeout_s = timeout_s
        self.sandbox = MathSandbox().start()

    def check(self, rollouts: list[list[Rollout]], truths: list[str], majority: bool) -> Verdicts:
        return _check(self.sandbox, rollouts, truths, self.timeout_s, majority)

    def close(self) -> None:
        self.sandbox.close()


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteVerifierWorker = ray.remote(VerifierWorker)


class VerifierPool:
    def __init__(self, timeout_s: float, workers: list[ray.actor.ActorHandle] | None = None):
        """`workers`: VerifierWorker handles; empty or None scores in-process."""
        self.timeout_s = timeout_s
        self.workers = workers or []

    @staticmethod
    def create(cfg: Config, placement: Placement | None = None) -> "VerifierPool":
        count = cfg.verifier.num_workers
        workers = [
            RemoteVerifierWorker.options(**(placement.options("verifier", i) if placement else {"num_cpus": 1})).remote(
                cfg.verifier.timeout_s
            )
            for i in range(count)
        ]
        return VerifierPool(cfg.verifier.timeout_s, workers)

    def check(self, pending: list[PendingRollouts], truths: list[str], majority: bool = False) -> Verdicts:
        """Verdicts for the rollouts of `pending` (from `GeneratorPool.generate`), in prompt order.

        `truths[i]` is the ground truth of prompt i. The shares' refs go to the verifier
        actors as they are: rollouts travel from generator to verifier through the object
        store, not through the driver. `majority`: also judge each prompt's majority answer.
        """
        per_share = [[truths[i] for i in share.indices] for share in pending]
        if not self.workers:
            from rayrep.verifier.math import default_sandbox

            results = [
                _check(default_sandbox(), ray.get(share.ref), share_truths, self.timeout_s, majority)
                for share, share_truths in zip(pending, per_share)
            ]
        else:
            results = ray.get([
                self.workers[i % len(self.workers)].check.remote(share.ref, share_truths, majority)
                for i, (share, share_truths) in enumerate(zip(pending, per_share))
            ])
        merged = Verdicts([], Counter(), [] if majority else None)
        for part in results:
            merged.correct.extend(part.correct)
            merged.statuses.update(part.statuses)
            if majority:
                merged.majority.extend(part.majority)
        return merged

    def shutdown(self) -> None:
        ray.get([worker.close.remote() for worker in self.workers])
