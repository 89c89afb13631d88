"""The rollouts of a step, in rounds: the algorithm plans a round, the generators sample it,
the verifiers mark it, and the planned replays join their groups.

A synchronous step is one round, started and finished. DAPO's dynamic sampling
(`algorithm.dynamic_sampling`) keeps the informative groups and asks for further rounds,
each planned as a value of its own, leaving out the step's questions. Asynchronous
rollouts (`run.max_policy_lag` = N > 0) start the next N steps' rounds before the update,
so the generators sample while the learners train; their answers are then up to N policy
versions old, and a group older than that is dropped, counted.

Partial rollouts (`run.partial_rollouts` = x > 0) keep B(1 + x) groups in flight: a round
asks the generators for new questions and for the groups carried over from the last round,
and each engine stops once its share of B groups is done and every carried group it holds:
the step does not wait for its longest answers. It trains on B done groups, the carried
ones first; the others are carried, their answers done or paused (tokens and log-probs so
far, in the object store), and finish in the next round under the newer weights, so an
answer spans at most one weight sync and every question started is trained on. A step that
saves a checkpoint gives its carried questions back to the sampler instead (asked again
from their prompts, counted): a checkpoint holds no paused answers, and a resumed run
repeats the uninterrupted one.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rayrep.algos.interface import Algorithm
from rayrep.config import Config
from rayrep.data import PromptSampler
from rayrep.generator.group import Share
from rayrep.run.record import StepRecord
from rayrep.roles.system import Runtime
from rayrep.types import PAUSED, Answer, Group, StepBatch, StepPlan, ToolUse


@dataclass(frozen=True)
class Carried:
    """A group a round stopped before all its answers were done (partial rollouts): its
    question's plan, and its answers, done or `PAUSED`, where the generators left them."""

    plan: StepPlan
    answers: tuple[Answer, ...]

    @property
    def oldest(self) -> int:
        """The policy version of its oldest token."""
        return min(a.version for a in self.answers)


@dataclass
class Round:
    """One round of a step's rollouts, started: what was planned, the generate call's shares
    (still sampling), and how long planning took, for the step that finishes it; with partial
    rollouts, the carried groups it continues (after the planned ones in the call)."""

    plan: StepPlan
    shares: list[Share]
    plan_seconds: float
    carried: list[Carried] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    """What starting it counted (carried groups too old to continue, dropped)."""


class Rollouts:
    def __init__(self, cfg: Config, runtime: Runtime, algorithm: Algorithm, sampler: PromptSampler,
                 prompt_ids: dict[str, list[int]]):
        self.cfg, self.runtime, self.algorithm = cfg, runtime, algorithm
        self.sampler, self.prompt_ids = sampler, prompt_ids
        self.ahead: deque[Round] = deque()
        """Later steps' rounds, sampling already (asynchronous rollouts)."""
        self.carried: list[Carried] = []
        """Groups stopped by the last round, to continue in the next (partial rollouts)."""

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
        groups, stale = drop_stale(groups, self.runtime.version, max_lag(self.cfg))
        record.count(stale)
        if self.carried and self.cfg.saves_checkpoint(step):
            # Questions from the sampler go back to it; a replay method's questions drawn from
            # its buffer (ExGRPO's `choose`) are drawn again from there, or not, in later steps.
            drawn = [c for c in self.carried if not c.plan.choose]
            self.sampler.give_back([c.plan.prompts[0].uid for c in drawn])
            record.count({"partial_groups_asked_again": len(drawn)})
            if len(drawn) < len(self.carried):
                record.count({"partial_replayed_groups_dropped": len(self.carried) - len(drawn)})
            self.carried = []
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
        wanted = self.cfg.algorithm.prompts_per_step
        counts = Counter()
        replaced = self.runtime.replace_dead_tools()
        if replaced:
            counts["tool_replaced"] += replaced
        carried, questions = self.carry_on(counts), wanted
        if self.cfg.run.partial_rollouts:
            questions = max(0, math.ceil(wanted * (1 + self.cfg.run.partial_rollouts)) - len(carried))
            exclude |= {c.plan.prompts[0].uid for c in carried}
        plan = self.algorithm.plan(self.sampler, questions, exclude, self.runtime.version)
        plan_seconds = time.perf_counter() - start
        gen = self.cfg.generator
        shares = self.runtime.generators.generate(
            [self.prompt_ids[p.uid] for p in plan.prompts], n=[n for _, n in plan.requests],
            temperature=gen.temperature, top_p=gen.top_p, max_tokens=gen.max_response_tokens,
            seeds=self.cfg.sampling_seeds(f"rollout-{step}-{number}", len(plan.prompts) + len(carried)),
            parts=gen.answer_parts, carried=[(self.prompt_ids[c.plan.prompts[0].uid], c.answers) for c in carried],
            quota=wanted if self.cfg.run.partial_rollouts else None,
        )
        return Round(plan, shares, plan_seconds, carried, counts)

    def carry_on(self, counts: Counter) -> list[Carried]:
        """The groups the last round stopped, taken for the next (partial rollouts), less those
        whose oldest token is already too old to train on (dropped, counted in `counts`)."""
        carried, self.carried = self.carried, []
        kept = [c for c in carried if self.runtime.version - c.oldest <= max_lag(self.cfg)]
        if len(kept) < len(carried):
            counts["partial_stale_groups_dropped"] += len(carried) - len(kept)
        return kept

    def finish(self, started: Round, record: StepRecord) -> list[Group]:
        """The round's rollouts (a generator that died is replaced and its prompts asked again,
        counted as `generator_replaced` and `generator_retried_prompts`), marked by the
        verifiers as they arrive, with the planned replays in their groups. `generate` times
        the wait for the last answers (with asynchronous rollouts: what the update did not
        hide), `verify` the wait for the verdicts after them (what scoring did not overlap)."""
        record.times["plan"] = record.times.get("plan", 0.0) + started.plan_seconds
        record.count({"sampling_rounds": 1, **started.counts})
        plans = started.plan.split() + [c.plan for c in started.carried]  # one per group, in call order
        questions = [p for plan in plans for p in plan.prompts]
        checking = self.runtime.verifiers.checking(questions)
        with record.timed("generate"):
            recovery: Counter = Counter()
            _, answers = self.runtime.generators.complete(started.shares, recovery, on_arrival=checking.send)
        record.count(recovery, prefix="generator_")
        with record.timed("verify"):
            verdicts = checking.result()
        record.count(verdicts.statuses, prefix="verifier_")
        record.note({f"verifier_{status}": detail for status, detail in verdicts.details.items()})
        return self.take(plans, answers, list(zip(verdicts.correct, verdicts.scores, verdicts.components)),
                         len(started.plan.prompts),
                         sum(a.policy_tokens for c in started.carried for a in c.answers), record)

    def take(self, plans: list[StepPlan], answers: list[list[Answer]],
             verdicts: list[tuple[list[bool], list[float | None], list[tuple]]], carried_from: int, tokens_before: int,
             record: StepRecord) -> list[Group]:
        """The step's groups of a round's (one plan each, in call order, those from
        `carried_from` on carried over from the last round, holding `tokens_before` tokens of the
        policy's as the round began; the verdicts (scores, their parts) of those done, in that
        order), each with its planned replays. Without partial rollouts every group is done, and the step takes them all.
        With them, it takes B, the carried ones first (their tokens are the oldest); the others
        are carried to the next round: those stopped, and any done beyond B; and the tokens
        the round generated are counted (`partial_round_tokens`)."""
        partial = self.cfg.run.partial_rollouts
        done = [i for i, own in enumerate(answers) if not any(a.finish_reason == PAUSED for a in own)]
        marks = dict(zip(done, verdicts))
        taken = sorted(done, key=lambda i: (i < carried_from, i))  # (without carried groups: call order)
        if partial:
            taken = taken[:self.cfg.algorithm.prompts_per_step]
        groups = [group for i in taken for group in plans[i].complete(
            [Group.sampled(plans[i].prompts[0], answers[i], *marks[i])])]
        carried = [Carried(plans[i], tuple(answers[i])) for i in range(len(plans)) if i not in set(taken)]
        # (Added to any that no round took yet: with asynchronous rollouts two or more steps
        # ahead, the round after this one was started before this one's groups were carried.)
        self.carried += carried
        if not partial:
            return groups
        paused = [a for c in carried for a in c.answers if a.finish_reason == PAUSED]
        record.count({"partial_round_tokens": sum(a.policy_tokens for own in answers for a in own) - tokens_before,
                      "partial_groups_carried": len(carried), "partial_answers_paused": len(paused),
                      "partial_tokens_paused": sum(a.length for a in paused)})
        return groups

    def stats(self, step_batch: StepBatch, record: StepRecord, version: int) -> dict[str, float]:
        """What the step's fresh rollouts looked like, and how old the trained answers were
        against `version`, the policy the update started from."""
        stats = rollout_stats(step_batch.seen, record.times["generate"], self.cfg.tools.enabled)
        if self.cfg.run.partial_rollouts:  # what the step's rounds generated, not what its answers hold
            stats["generated_tokens"] = record.counts["partial_round_tokens"]
            stats["tokens_per_second"] = stats["generated_tokens"] / max(record.times["generate"], 1e-9)
        return {**stats, **policy_lag_stats(step_batch.groups, version)}


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


def max_lag(cfg: Config) -> int:
    """How many versions older than the policy an update starts from a trained answer's oldest
    token may be: `run.max_policy_lag` N; with partial rollouts max(1, 2N), since a group
    stopped in a round sampled N steps ahead continues in the round started N steps later."""
    lag = cfg.run.max_policy_lag
    return max(1, 2 * lag) if cfg.run.partial_rollouts else lag


def drop_stale(groups: list[Group], version: int, max_lag: int) -> tuple[list[Group], dict[str, int]]:
    """Groups whose fresh rollouts are more than `max_lag` versions older than `version`
    (the learners' policy, which the update starts from) are not trained on; counted."""
    kept = [g for g in groups
            if all(version - a.version <= max_lag for a in g.fresh())]
    stale = len(groups) - len(kept)
    return kept, ({"stale_groups_dropped": stale} if stale else {})


def policy_lag_stats(groups: Sequence[Group], version: int) -> dict[str, float]:
    """How many versions older than the policy the update started from (`version`) the
    trained answers are (of their oldest tokens): fresh ones' histogram (`fresh_lag_<k>`:
    answers), mean and max; replayed ones' mean; with partial rollouts, the share of fresh
    tokens sampled by an older policy than the one that finished their answer."""
    fresh = [version - a.version for g in groups for a in g.fresh()]
    replay = [version - a.version for g in groups for a in g.replays()]
    stats: dict[str, float] = {f"fresh_lag_{k}": n for k, n in sorted(Counter(fresh).items())}
    if fresh:
        stats.update(fresh_lag_mean=sum(fresh) / len(fresh), fresh_lag_max=max(fresh))
    if replay:
        stats["replay_lag_mean"] = sum(replay) / len(replay)
    earlier = sum(a.earlier_tokens for g in groups for a in g.fresh())
    if earlier:  # partial rollouts: answers continued under newer weights
        tokens = sum(a.length for g in groups for a in g.fresh())
        stats["fresh_earlier_token_share"] = earlier / max(1, tokens)
    return stats


def rollout_stats(groups: Sequence[Group], generate_seconds: float, tools: bool = False) -> dict[str, float]:
    """What this step's fresh rollouts looked like (every verified group, trained or not);
    with `tools` (answers that may call a tool), how they called it (`tool_call_share`,
    `tool_calls_per_answer`, `turns_per_answer`, `tool_errors`, `tool_timeouts`,
    `tool_failures`: answers whose call was lost twice, `tool_retried_calls`: calls asked
    again, their tool actor having died, `tool_seconds`: the calls' summed time in the tool actors,
    `tool_token_share`: of the answers' tokens, the tools' outputs');
    with questions of several data sources, the accuracy and mean reward of each
    (`accuracy/<source>`, `reward/<source>`); the mean of each named part of the answers'
    scores, over the answers that have it (`checker_<name>`, `format_<term>`)."""
    fresh = [a for g in groups for a in g.fresh()]
    tokens = sum(a.length for a in fresh)
    used = [a.tools for a in fresh if a.tools is not None]
    generated = sum(a.policy_tokens for a in fresh)  # (a tool's output is not generated)
    stats = {
        "accuracy": sum(bool(a.correct) for a in fresh) / max(1, len(fresh)),
        "response_length": tokens / max(1, len(fresh)),
        "truncated": sum(a.finish_reason == "length" for a in fresh) / max(1, len(fresh)),
        "generated_tokens": generated,
        "tokens_per_second": generated / max(generate_seconds, 1e-9),
    }
    if tools:
        total = sum(used, ToolUse())
        stats.update({
            "tool_call_share": len(used) / max(1, len(fresh)),
            "tool_calls_per_answer": total.calls / max(1, len(fresh)),
            "turns_per_answer": 1 + total.calls / max(1, len(fresh)),
            "tool_errors": total.errors, "tool_timeouts": total.timeouts,
            "tool_failures": sum(use.failed for use in used), "tool_retried_calls": total.retried,
            "tool_seconds": total.seconds,
            "tool_token_share": (tokens - generated) / max(1, tokens),
        })
    by_source: dict[str, list[Answer]] = {}
    for group in groups:
        by_source.setdefault(group.prompt.data_source, []).extend(group.fresh())
    if len(by_source) > 1:
        for source, answers in sorted(by_source.items()):
            if answers:
                stats[f"accuracy/{source}"] = sum(bool(a.correct) for a in answers) / len(answers)
                stats[f"reward/{source}"] = sum(a.reward or 0.0 for a in answers) / len(answers)
    parts: dict[str, list[float]] = {}
    for answer in fresh:
        for name, value in answer.components:
            parts.setdefault(name, []).append(value)
    stats.update({name: sum(values) / len(values) for name, values in sorted(parts.items())})
    return stats
