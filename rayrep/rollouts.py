"""The rollouts of a step, in rounds: the algorithm plans a round, the generators sample it,
the verifiers mark it, and the planned replays join their groups.

A synchronous step is one round, started and finished. DAPO's dynamic sampling
(`algorithm.dynamic_sampling`) keeps the informative groups and asks for further rounds,
each planned as a value of its own, leaving out the step's questions. Asynchronous
rollouts (`run.max_policy_lag` = N > 0) start the next N steps' rounds before the update,
so the generators sample while the learners train; their answers are then up to N policy
versions old, and a group older than that is dropped, counted.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rayrep.algos.interface import Algorithm
from rayrep.config import Config
from rayrep.data import PromptSampler
from rayrep.generator.group import Share
from rayrep.run.record import StepRecord
from rayrep.runtime.system import Runtime
from rayrep.types import Group, StepBatch, StepPlan


@dataclass
class Round:
    """One round of a step's rollouts, started: what was planned, the generate call's shares
    (still sampling), and how long planning took, for the step that finishes it."""

    plan: StepPlan
    shares: list[Share]
    plan_seconds: float


class Rollouts:
    def __init__(self, cfg: Config, runtime: Runtime, algorithm: Algorithm, sampler: PromptSampler,
                 prompt_ids: dict[str, list[int]]):
        self.cfg, self.runtime, self.algorithm = cfg, runtime, algorithm
        self.sampler, self.prompt_ids = sampler, prompt_ids
        self.ahead: deque[Round] = deque()
        """Later steps' rounds, sampling already (asynchronous rollouts)."""

    def collect(self, step: int, record: StepRecord) -> tuple[list[Group], list[Group]]:
        """Step `step`'s verified groups: (those to train on, those verified but left out by
        dynamic sampling). Groups too old for `run.max_policy_lag` are dropped, counted."""
        started = self.ahead.popleft() if self.ahead else self.start(step)
        groups = self.finish(started, record)
        dropped: list[Group] = []
        if self.cfg.algorithm.dynamic_sampling:
            def another_round(number: int, taken: frozenset[str]) -> list[Group]:
                return self.finish(self.start(step, number, taken), record)

            groups, dropped, kept = keep_informative(groups, self.cfg.algorithm.prompts_per_step, another_round)
            record.add(kept)
        groups, stale = drop_stale(groups, self.runtime.version, self.cfg.run.max_policy_lag)
        record.count(stale)
        return groups, dropped

    def start_ahead(self, step: int) -> None:
        """Asynchronous rollouts: the next steps' rounds start sampling on these weights while
        the learners update (the weight sync waits for them). Never across a checkpoint: a
        resumed run starts its next round afresh, as the uninterrupted run does."""
        while len(self.ahead) < rounds_ahead(self.cfg, step):
            self.ahead.append(self.start(step + 1 + len(self.ahead)))

    def start(self, step: int, number: int = 1, exclude: frozenset[str] = frozenset()) -> Round:
        """Round `number` of step `step`: the algorithm plans it (B questions, from the sampler
        and, for the replay methods, the buffer; none of `exclude`), and the generators start
        sampling the planned fresh rollouts, each prompt with its own seed (the step and round
        decide it). Returns at once."""
        start = time.perf_counter()
        plan = self.algorithm.plan(self.sampler, self.cfg.algorithm.prompts_per_step, exclude, self.runtime.version)
        plan_seconds = time.perf_counter() - start
        gen = self.cfg.generator
        shares = self.runtime.generators.generate(
            [self.prompt_ids[p.uid] for p in plan.prompts], n=[n for _, n in plan.requests],
            temperature=gen.temperature, top_p=gen.top_p, max_tokens=gen.max_response_tokens,
            seeds=self.cfg.sampling_seeds(f"rollout-{step}-{number}", len(plan.prompts)), parts=gen.answer_parts,
        )
        return Round(plan, shares, plan_seconds)

    def finish(self, started: Round, record: StepRecord) -> list[Group]:
        """The round's rollouts (a generator that died is replaced and its prompts asked again,
        counted as `generator_replaced` and `generator_retried_prompts`), marked by the
        verifiers as they arrive, with the planned replays in their groups. `generate` times
        the wait for the last answers (with asynchronous rollouts: what the update did not
        hide), `verify` the wait for the verdicts after them (what scoring did not overlap)."""
        record.times["plan"] = record.times.get("plan", 0.0) + started.plan_seconds
        record.count({"sampling_rounds": 1})
        plan = started.plan
        checking = self.runtime.verifiers.checking([p.ground_truth for p in plan.prompts])
        with record.timed("generate"):
            recovery: Counter = Counter()
            _, rollouts = self.runtime.generators.complete(started.shares, recovery, on_arrival=checking.send)
        record.count(recovery, prefix="generator_")
        with record.timed("verify"):
            verdicts = checking.result()
        record.count(verdicts.statuses, prefix="verifier_")
        fresh = [
            Group(prompt, tuple(sampled), tuple(marks), (False,) * len(sampled))
            for prompt, sampled, marks in zip(plan.prompts, rollouts, verdicts.correct)
        ]
        return plan.complete(fresh)

    def stats(self, step_batch: StepBatch, record: StepRecord, version: int) -> dict[str, float]:
        """What the step's fresh rollouts looked like, and how old the trained answers were
        against `version`, the policy the update started from."""
        return {**rollout_stats(step_batch.seen, record.times["generate"]),
                **policy_lag_stats(step_batch.groups, version)}


def keep_informative(
    groups: list[Group], wanted: int, more: Callable[[int, frozenset[str]], list[Group]], max_rounds: int = 4
) -> tuple[list[Group], list[Group], dict[str, float]]:
    """DAPO's dynamic sampling, over complete groups (fresh rollouts and planned replays):
    keep the groups whose rollouts are neither all right nor all wrong, and ask `more` for
    another round (given its number, 2 for the first refill, which keys its seeds, and the
    questions already in this step, to leave out) until `wanted` groups are kept or
    `max_rounds` extra rounds ran; then train on what there is.

    Returns (the kept groups, at most `wanted`; every other verified group; metrics).
    """
    kept = [g for g in groups if g.informative]
    dropped = [g for g in groups if not g.informative]
    metrics = {"dynamic_sampling_kept": len(kept) / max(1, len(groups))}
    rounds = 0
    while len(kept) < wanted and rounds < max_rounds:
        rounds += 1
        new = more(rounds + 1, frozenset(g.prompt.uid for g in kept + dropped))
        kept += [g for g in new if g.informative]
        dropped += [g for g in new if not g.informative]
    metrics["dynamic_sampling_rounds"] = rounds
    return kept[:wanted], dropped + kept[wanted:], metrics


def rounds_ahead(cfg: Config, step: int) -> int:
    """How many later steps' rounds sample while step `step` updates: `run.max_policy_lag`,
    but none past the run's end or across a step that saves a checkpoint."""
    ahead = 0
    while ahead < cfg.run.max_policy_lag and step + ahead < cfg.run.steps:
        if cfg.run.save_every and (step + ahead) % cfg.run.save_every == 0:
            break
        ahead += 1
    return ahead


def drop_stale(groups: list[Group], version: int, max_lag: int) -> tuple[list[Group], dict[str, int]]:
    """Groups whose fresh rollouts are more than `max_lag` versions older than `version`
    (the learners' policy, which the update starts from) are not trained on; counted."""
    kept = [g for g in groups
            if all(version - a.rollout.version <= max_lag for a in g.fresh())]
    stale = len(groups) - len(kept)
    return kept, ({"stale_groups_dropped": stale} if stale else {})


def policy_lag_stats(groups: Sequence[Group], version: int) -> dict[str, float]:
    """How many versions older than the policy the update started from (`version`) the
    trained answers are: fresh ones' histogram (`fresh_lag_<k>`: answers), mean and max; replayed ones' mean."""
    fresh = [version - a.rollout.version for g in groups for a in g.fresh()]
    replay = [version - a.rollout.version for g in groups for a in g.replays()]
    stats: dict[str, float] = {f"fresh_lag_{k}": n for k, n in sorted(Counter(fresh).items())}
    if fresh:
        stats.update(fresh_lag_mean=sum(fresh) / len(fresh), fresh_lag_max=max(fresh))
    if replay:
        stats["replay_lag_mean"] = sum(replay) / len(replay)
    return stats


def rollout_stats(groups: Sequence[Group], generate_seconds: float) -> dict[str, float]:
    """What this step's fresh rollouts looked like (every verified group, trained or not)."""
    answers = [a for g in groups for a in g.fresh()]
    fresh, marks = [a.rollout for a in answers], [a.correct for a in answers]
    tokens = sum(r.response_length for r in fresh)
    return {
        "accuracy": sum(marks) / max(1, len(marks)),
        "response_length": tokens / max(1, len(fresh)),
        "truncated": sum(r.finish_reason == "length" for r in fresh) / max(1, len(fresh)),
        "generated_tokens": tokens,
        "tokens_per_second": tokens / max(generate_seconds, 1e-9),
    }
