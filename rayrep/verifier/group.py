"""VerifierGroup: CPU actors scoring completions in parallel, each question by its checker.

Each question goes with the checker its `data_source` is routed to (`verifier.reward`,
`verifier.by_source`: math-verify, a text checker or a user's function,
`rayrep.verifier.checkers`). Each VerifierWorker owns a `MathSandbox` (a child process with a
hard per-item time limit, holding the user's checkers), so one hanging input costs at most
`verifier.timeout_s` and never stalls a step longer than that. Verdict statuses (ok /
no_answer / timeout / error / bad_value) come back with the verdicts, with the first detail
of each status that is not ok, so the driver can count and report them per step. For
evaluation, the group also votes: each question's majority answer (maj@k) is judged where
its answers are.

A verifier actor that dies (its process killed, its node lost) loses no work: the group
starts a new one in the same placement-group bundle and sends it the dead one's shares
again, up to `MAX_RETRIES` times per share, then fails naming the verifier and the cause.
Each call's `Verdicts.statuses` counts the replacements and the re-sent completions.

With `verifier.num_workers = 0` the group scores in-process through the same sandbox code.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import ray
from ray.exceptions import RayActorError

from rayrep.cluster.placement import Placement
from rayrep.cluster.supervisor import Supervisor
from rayrep.config import Config
from rayrep.generator.group import PendingRollouts
from rayrep.library_output import route_library_output
from rayrep.types import TOOL_FAILED, Prompt, Rollout
from rayrep.verifier.checkers import CheckerError, Plugin, Routing, format_values, normalise
from rayrep.verifier.code import CodeLimits, parse_tests
from rayrep.verifier.final_answer import Verdict
from rayrep.verifier.sandbox import MathSandbox, SandboxError
from rayrep.verifier.voting import maj_at_k


class Question(NamedTuple):
    """What a verifier needs of a question: its checker, its ground truth and its row."""

    checker: str
    ground_truth: str
    row: dict

    @classmethod
    def of(cls, prompt: Prompt, routing: Routing) -> "Question":
        row = {"data_source": prompt.data_source, "prompt": [dict(m) for m in prompt.messages],
               "ground_truth": prompt.ground_truth, **prompt.extra}
        return cls(routing.checker(prompt.data_source), prompt.ground_truth, row)


def check_checkers(cfg: Config, prompts: Sequence[Prompt]) -> None:
    """The code checker's rows' tests read, and every user's checker the config names tried,
    before any actor starts: its file read,
    loaded in a sandbox child as the verifiers load it (it imports; its function takes
    (completion, ground_truth, row)), and called, under the verifiers' time limit, on the
    first of `prompts` routed to it, with that row's ground truth as the completion; it must
    give a score. CheckerError naming the checker and what is wrong."""
    routing = Routing.of(cfg.verifier)
    first: dict[str, Prompt] = {}
    for prompt in prompts:
        checker = routing.checker(prompt.data_source)
        first.setdefault(checker, prompt)
        if checker == "code":
            try:
                parse_tests(prompt.ground_truth)
            except ValueError as err:
                raise CheckerError(f"question {prompt.uid!r} (data_source {prompt.data_source!r}), scored by the code "
                                   f"checker: {err}") from None
    for user_checker in routing.plugins():
        sandbox = MathSandbox(plugins=(user_checker,), keep_spare=False)
        try:
            try:
                sandbox.start()
            except SandboxError as err:
                raise CheckerError(str(err)) from None
            prompt = first.get(user_checker.spec)
            if prompt is None:
                continue  # (no row routed to it: loaded, not called)
            question = Question.of(prompt, routing)
            (verdict,) = sandbox.check_batch([(question.checker, question.ground_truth, question.ground_truth,
                                               question.row)], cfg.verifier.timeout_s)
            if verdict.status != "ok":
                raise CheckerError(f"checker {user_checker.spec!r} on question {prompt.uid!r} (data_source "
                                   f"{prompt.data_source!r}), its ground truth as the answer: {verdict.status}: "
                                   f"{verdict.detail}")
        finally:
            sandbox.close()


@dataclass
class Verdicts:
    """Correctness of each rollout, prompt by prompt; how many verdicts of each status; and,
    when asked for, whether each prompt's majority answer is correct.

    `statuses` counts verdicts by status (ok / no_answer / timeout / error) and, only when
    a verifier died during the call, the recovery: `replaced` (new verifier actors started)
    and `retried_items` (completions sent again to a verifier)."""

    correct: list[list[bool]]
    statuses: Counter
    majority: list[bool | None] | None = None
    """Per question, whether its majority answer is right (None: its checker reads no answer
    to vote on)."""
    scores: list[list[float | None]] | None = None
    """Per answer, its checker's score (None: a checker that only judges, or no score)."""
    details: dict[str, str] = field(default_factory=dict)
    """The first detail of each status other than ok (for the step's log)."""
    components: list[list[tuple]] | None = None
    """Per answer, the named parts of its score (a user's checker's, the format terms')."""


@dataclass(frozen=True)
class Settings:
    """How a verifier checks: its time limit per completion, a score's success threshold,
    the code checker's limits on each run of a program."""

    timeout_s: float
    success_threshold: float = 1.0
    code: CodeLimits = CodeLimits()
    terms: tuple[tuple[str, float], ...] = ()
    """`verifier.format_terms`: (term, weight), added to each answer's score."""
    style: str = "binary"
    """`verifier.reward_style`: a verdict's score, where format terms are added to it."""


def _check(sandbox: MathSandbox, rollouts: list[list[Rollout]], questions: list[Question], settings: Settings,
           majority: bool) -> Verdicts:
    checks = [(q.checker, rollout.text, q.ground_truth, q.row) for q, per_prompt in zip(questions, rollouts)
              for rollout in per_prompt]
    verdicts = sandbox.check_batch(checks, settings.timeout_s, settings.success_threshold)
    failed = [rollout.finish_reason == TOOL_FAILED for per_prompt in rollouts for rollout in per_prompt]
    if any(failed):  # an answer cut short by a lost tool call is wrong, whatever its text says
        verdicts = [Verdict(False, "tool_failed", None, "its tool call was lost twice") if lost else verdict
                    for verdict, lost in zip(verdicts, failed)]
    if settings.terms:
        verdicts = [_with_format_terms(v, text, settings) for v, (_, text, _, _) in zip(verdicts, checks)]
    flat = iter(verdicts)
    judged = [[next(flat) for _ in per_prompt] for per_prompt in rollouts]
    details: dict[str, str] = {}
    for verdict in verdicts:
        if verdict.status != "ok":
            details.setdefault(verdict.status, verdict.detail)
    votes = None
    if majority:
        votes = [_majority(sandbox, [r.text for r in per_prompt], question, own, settings.timeout_s)
                 for per_prompt, question, own in zip(rollouts, questions, judged)]
    return Verdicts([[v.correct for v in own] for own in judged], Counter(v.status for v in verdicts), votes,
                    [[v.score for v in own] for own in judged], details, [[v.components for v in own] for own in judged])


def _with_format_terms(verdict: Verdict, completion: str, settings: Settings) -> Verdict:
    """The verdict with the format terms' weighted values added to its score (a checker that
    only judges: to its verdict's reward in the run's style) and kept as its components."""
    values = format_values(completion, settings.terms)
    base = verdict.reward(settings.style)
    bonus = sum(weight * value for (_, weight), (_, value) in zip(settings.terms, values))
    return dataclasses.replace(verdict, score=base + bonus, components=verdict.components + tuple(values))


def _majority(sandbox: MathSandbox, texts: list[str], question: Question, verdicts, timeout_s: float) -> bool | None:
    """Whether the question's majority answer is right: math-verify's vote for `math`; for
    the text checkers the answers read and normalised as they read them (their verdicts
    judge the winner); None for a user's checker, which reads no answer to vote on."""
    if question.checker == "math":
        return maj_at_k(texts, question.ground_truth, timeout_s=timeout_s, sandbox=sandbox) == 1.0
    if question.checker not in ("exact", "choice"):
        return None
    votes: Counter = Counter()
    right: dict[str, bool] = {}
    for verdict in verdicts:
        if verdict.answer is not None:
            key = normalise(verdict.answer)
            votes[key] += 1
            right.setdefault(key, verdict.correct)
    return bool(votes) and right[max(votes, key=lambda key: votes[key])]  # (ties: the first seen, as maj_at_k)


class VerifierWorker:
    # A sync actor: its methods run one at a time on the main thread, and the sandbox
    # enforces the time limit from there.
    def __init__(self, settings: Settings, plugins: tuple[Plugin, ...] = ()):
        route_library_output()
        self.settings = settings
        self.sandbox = MathSandbox(plugins=plugins, code_limits=settings.code).start()

    def check(self, rollouts: list[list[Rollout]], questions: list[Question], majority: bool) -> Verdicts:
        return _check(self.sandbox, rollouts, questions, self.settings, majority)

    def pid(self) -> int:
        """The actor's process id; answering at all shows that the actor is alive."""
        return os.getpid()

    def close(self) -> None:
        self.sandbox.close()


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteVerifierWorker = ray.remote(VerifierWorker)


def _start_worker(settings: Settings, plugins: tuple[Plugin, ...], placement: Placement | None,
                  index: int) -> ray.actor.ActorHandle:
    """Verifier `index`, in its bundle of `placement` (or on one CPU anywhere)."""
    options = placement.options("verifier", index) if placement else {"num_cpus": 1}
    return RemoteVerifierWorker.options(**options).remote(settings, plugins)


class VerifierGroup:
    def __init__(self, settings: Settings, workers: list[ray.actor.ActorHandle] | None = None,
                 placement: Placement | None = None, routing: Routing = Routing(),
                 plugins: tuple[Plugin, ...] = ()):
        """`workers`: VerifierWorker handles; empty or None scores in-process. `placement`:
        where worker i was started (`placement.options("verifier", i)`), so that a dead
        worker's replacement takes its bundle; None: one CPU anywhere. `routing`: each
        question's checker; `plugins`: the user's checkers it names (read by `create`)."""
        self.settings, self.routing, self.plugins = settings, routing, plugins
        self.supervisor = Supervisor("verifier", workers or [],
                                     lambda slot: _start_worker(settings, plugins, placement, slot))
        self.workers = self.supervisor.workers
        self._local: MathSandbox | None = None

    @staticmethod
    def create(cfg: Config, placement: Placement | None = None) -> "VerifierGroup":
        verifier = cfg.verifier
        settings = Settings(verifier.timeout_s, verifier.success_threshold, CodeLimits.of(verifier), verifier.terms,
                            verifier.reward_style)
        routing = Routing.of(cfg.verifier)
        plugins = routing.plugins()
        workers = [_start_worker(settings, plugins, placement, i) for i in range(cfg.verifier.num_workers)]
        return VerifierGroup(settings, workers, placement, routing, plugins)

    def check(self, pending: Sequence[PendingRollouts], prompts: Sequence[Prompt], majority: bool = False) -> Verdicts:
        """Verdicts for the rollouts of `pending`, in prompt order: `checking`, given every part at once."""
        checking = self.checking(prompts, majority)
        for part in pending:
            checking.send(part)
        return checking.result()

    def checking(self, prompts: Sequence[Prompt], majority: bool = False) -> "Checking":
        """A check whose parts are sent as they arrive (`GeneratorGroup.complete`'s `on_arrival`)
        and whose verdicts are read once all are in. `prompts[i]` is the question of prompt i
        (its checker, ground truth and row); `majority`: also judge each prompt's majority answer."""
        return Checking(self, [Question.of(p, self.routing) for p in prompts], majority)

    def local_sandbox(self) -> MathSandbox:
        """The sandbox that scores in this process (a group without actors)."""
        if self._local is None:
            self._local = MathSandbox(plugins=self.plugins, code_limits=self.settings.code).start()
        return self._local

    def shutdown(self) -> None:
        """Closes every live worker's sandbox; a dead worker has nothing left to close."""
        if self._local is not None:
            self._local.close()
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

    def __init__(self, group: VerifierGroup, questions: list[Question], majority: bool):
        self.group, self.questions, self.majority = group, questions, majority
        self.parts: list[PendingRollouts] = []
        self.sent: list[tuple[ray.actor.ActorHandle, ray.ObjectRef]] = []
        """Each part's verifier and the ref of its verdicts (for a group with actors)."""

    def send(self, part: PendingRollouts) -> None:
        self.parts.append(part)
        workers = self.group.workers
        if workers:
            self.sent.append(self._submit(len(self.parts) - 1, workers[(len(self.parts) - 1) % len(workers)]))

    def _questions(self, part: PendingRollouts) -> list[Question]:
        return [self.questions[i] for i in part.indices]

    def _submit(self, key: int, worker) -> tuple[ray.actor.ActorHandle, ray.ObjectRef]:
        part = self.parts[key]
        return worker, worker.check.remote(part.ref, self._questions(part), self.majority)

    def result(self) -> Verdicts:
        """The verdicts of every part sent, in prompt order (waits for the verifiers)."""
        counts: Counter = Counter()
        if not self.group.workers:
            results = [_check(self.group.local_sandbox(), ray.get(part.ref), self._questions(part),
                              self.group.settings, self.majority) for part in self.parts]
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
        scores: dict[int, list[float | None]] = {}
        components: dict[int, list[tuple]] = {}
        majority: dict[int, bool | None] = {}
        statuses: Counter = Counter()
        details: dict[str, str] = {}
        for part, verdicts in zip(self.parts, results):
            correct.update(zip(part.indices, verdicts.correct))
            scores.update(zip(part.indices, verdicts.scores))
            components.update(zip(part.indices, verdicts.components))
            if self.majority:
                majority.update(zip(part.indices, verdicts.majority))
            statuses.update(verdicts.statuses)
            details = {**verdicts.details, **details}  # (the first part's first)
        statuses.update(counts)
        order = sorted(correct)
        return Verdicts([correct[i] for i in order], statuses, [majority[i] for i in order] if self.majority else None,
                        [scores[i] for i in order], details, [components[i] for i in order])
