"""The few data contracts that cross component boundaries.

Names, used the same way everywhere:
- an **answer** (`Answer`) is one response to one question, the one record of it in every
  role: what the driver decides on (its verdict, reward, advantage, length, finish reason,
  policy versions, whether it was replayed, and what the replay buffer keeps of it) and
  where its arrays are (`Answer.at`: with the generator that sampled it or the buffer
  shard that drew it, read by the roles that need them with `answer_arrays`);
- a **rollout** (`Rollout`) is an answer's arrays themselves, token ids and the behaviour
  log-probs of the policy that produced them, as a generator made them (and, in an answer
  that called a tool, which tokens the tool's output wrote: `tool_mask`);
- a **group** is one question's answers in one training step (G fresh + M replayed).

A field exists only when something reads it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Prompt:
    """One question of a prompt set, whatever file or generator it came from.

    `messages` is a chat list (`[{"role": "user", "content": ...}]`); a prompt given as a
    plain string becomes one user message, so every model renders prompts the same way,
    through its tokenizer's chat template.
    """

    uid: str
    """Stable question id: the replay buffer's key and the shard routing key."""
    messages: tuple[dict, ...]
    ground_truth: str
    """Reference answer the verifier compares the completion's final answer against."""
    data_source: str = "unknown"
    extra: dict = field(default_factory=dict, compare=False)
    """Row fields kept for the user (`extra_info`, `ability`); nothing in rayrep reads them."""

    @property
    def text(self) -> str:
        """The last user message: the question itself, for logs and plots."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


@dataclass(frozen=True, eq=False)
class Rollout:
    """An answer's arrays, as a generator made them (the record the other roles hold of the
    answer is an `Answer`, which says where these are).

    Token ids and log-probs are arrays (int32, float32; given as any sequence, they become
    such), never lists of Python numbers: an array crosses Ray as one buffer, read in place,
    where a list of 3,000 numbers is 3,000 objects to pickle, unpickle and hold
    (`bench/driver_data.py`). The answers to one prompt share its prompt's array."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    """Behaviour policy's log-prob of each response token (same length as response_ids)."""
    text: str
    finish_reason: str
    """'stop' (the policy ended its answer), 'length' (cut at the response limit) or, for an
    answer a generator stopped before its end (partial rollouts), `PAUSED`."""
    version: int = 0
    """Policy version (number of weight syncs) of the weights that sampled it: of its oldest
    token, where an answer was continued under newer weights (`token_versions`)."""
    token_versions: np.ndarray | None = None
    """Each response token's policy version (int32), for an answer sampled across weight
    syncs (partial rollouts); None: every token's is `version`."""
    tool_mask: np.ndarray | None = None
    """Each response token: True where a tool's output wrote it (bool; context the policy
    reads, never trained on; its log-prob NaN), in an answer that called a tool; None: the
    policy wrote every token."""
    tools: ToolUse | None = None
    """What its tool calls did (None: it called none)."""

    def __post_init__(self):
        for name, dtype in (("prompt_ids", np.int32), ("response_ids", np.int32), ("logprobs", np.float32),
                            ("token_versions", np.int32), ("tool_mask", np.bool_)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, np.ndarray) and value.dtype == dtype):
                object.__setattr__(self, name, np.asarray(value, dtype))
        if self.tool_mask is not None and not self.tool_mask.any():  # (one form of "the policy wrote them all")
            object.__setattr__(self, "tool_mask", None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Rollout):
            return NotImplemented
        return (np.array_equal(self.prompt_ids, other.prompt_ids) and np.array_equal(self.response_ids, other.response_ids)
                and np.array_equal(self.logprobs, other.logprobs, equal_nan=True)
                and np.array_equal(self.versions(), other.versions())
                and np.array_equal(self.tool_tokens(), other.tool_tokens())
                and (self.tools and self.tools.counts()) == (other.tools and other.tools.counts())
                and (self.text, self.finish_reason, self.version) == (other.text, other.finish_reason, other.version))

    def versions(self) -> np.ndarray:
        """Each response token's policy version."""
        if self.token_versions is not None:
            return self.token_versions
        return np.full(len(self.response_ids), self.version, np.int32)

    def tool_tokens(self) -> np.ndarray:
        """Each response token: whether a tool wrote it."""
        if self.tool_mask is not None:
            return self.tool_mask
        return np.zeros(len(self.response_ids), np.bool_)

    @property
    def earlier_tokens(self) -> int:
        """How many of its tokens an older policy sampled than the one that finished it (an
        answer continued across weight syncs; 0 for one sampled whole; a tool's tokens are
        not sampled)."""
        if self.token_versions is None or not len(self.token_versions):
            return 0
        return int(((self.token_versions < self.token_versions[-1]) & ~self.tool_tokens()).sum())

    __hash__ = None  # (arrays: a rollout is not a key)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def answer_arrays(self, key: object = None) -> AnswerArrays:
        """A rollout is its own source."""
        return AnswerArrays(self.prompt_ids, self.response_ids, self.logprobs, self.tool_mask)


class ToolUse(NamedTuple):
    """What an answer's tool calls did (`rayrep.generator.turns`): each call ran, failed
    (`errors`: the tool raised or its output was refused), or ran out of time."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    """The calls' time in the tool workers."""
    tokens: int = 0
    """Response tokens the tools' outputs wrote (the chat template's framing of them included)."""
    failed: bool = False
    """A call was lost twice (its tool worker died, then the one it was retried on): the
    answer ended there, and is scored wrong (`TOOL_FAILED`)."""
    retried: int = 0
    """Calls asked again of another tool worker, theirs having died."""

    def counts(self) -> "ToolUse":
        """What the calls did, without how they got done (their time, their retries)."""
        return self._replace(seconds=0.0, retried=0)

    def __add__(self, other: "ToolUse") -> "ToolUse":  # type: ignore[override]
        return ToolUse(*(a + b if not isinstance(a, bool) else a or b for a, b in zip(self, other)))


class AnswerArrays(NamedTuple):
    """An answer's arrays, as every role reads them (`answer_arrays`)."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    """The behaviour policy's log-prob of each response token; NaN where unknown (and on a
    tool's tokens)."""
    tool_mask: np.ndarray | None = None
    """Each response token: True where a tool's output wrote it; None: none did."""

    @property
    def logprobs_known(self) -> bool:
        """Whether every token the policy wrote has its behaviour log-prob (a tool's tokens
        have none)."""
        policy = self.logprobs if self.tool_mask is None else self.logprobs[~self.tool_mask]
        return not np.isnan(policy).any()


class AnswerSource(Protocol):
    """Where answers' arrays are kept: a generator's part of a generate call (`RolloutPart`),
    a draw of stored answers (`rayrep.buffer.answers.PackedAnswers`), or one `Rollout`."""

    def answer_arrays(self, key) -> AnswerArrays:
        """Answer `key`'s arrays."""
        ...


class RolloutPart(list):
    """What a generator returns for one part of a generate call: per prompt of the part, its
    rollouts (a list of lists, as verifiers read it), kept in the object store; answer
    (p, a) is the a-th rollout of the part's p-th prompt."""

    def answer_arrays(self, key: tuple[int, int]) -> AnswerArrays:
        prompt, answer = key
        return self[prompt][answer].answer_arrays()


PAUSED = "paused"
"""The finish reason of an answer that a generator stopped before its end, its tokens and
log-probs so far kept, to be continued in a later call (partial rollouts)."""

TOOL_FAILED = "tool_failed"
"""The finish reason of an answer whose tool call was lost twice (`ToolUse.failed`): it ends
there, and its verdict is wrong."""

VERDICT_NAMES = {True: "correct", False: "wrong", None: "unchecked"}
"""An answer's verdict (`Answer.correct`) as the replay buffer's files name it."""


class Answer(NamedTuple):
    """One answer to one question: the one record of it in every role, from the generator
    that samples it, through the verifiers, the algorithm and the learners, to the replay
    buffer and back. It holds what the driver decides on and where its arrays are (`at`,
    `key`), never the arrays: the roles that need them read them there (`answer_arrays`).
    Each role's record is made from the last one's (`_replace`).

    A new per-answer field is one field here (and, if the replay buffer keeps it, a field of
    `rayrep.buffer.answers.FACTS` and a column of the snapshot files).

    A named tuple, not a dataclass: a step makes and sends tens of thousands of them, and a
    tuple is made 3.5x and pickled 2.6x as fast (measured: 1.1 against 3.7 us per copy with
    one field changed)."""

    at: object
    """Where its arrays are: an object ref to an `AnswerSource` (a generator's part, a
    shard's draw), or the source itself, here (a `Rollout` is its own source; the answers
    of an in-process buffer's draw and of files read here)."""
    key: object = None
    """Its place in `at` (None where `at` is the answer's own `Rollout`)."""
    length: int = 0
    """Response tokens."""
    finish_reason: str = "stop"
    """'stop', 'length' (cut at the response limit) or `PAUSED` (partial rollouts)."""
    version: int = 0
    """The policy version that sampled it (of its oldest token, where it was continued
    under newer weights)."""
    earlier_tokens: int = 0
    """Tokens sampled by an older policy than its last (`Rollout.earlier_tokens`)."""
    correct: bool | None = None
    """The verifier's verdict; None: not checked (not yet, or an imported answer that its
    writer verified)."""
    reward: float | None = None
    """None until the algorithm has scored its group (verdict plus shaping), or, stored, the
    reward it had."""
    advantage: float | None = None
    """The advantage it trains with (in the learners' batch), or was trained with when it was
    stored (answer-level replay); None: not known yet (taken over its group's rewards)."""
    replayed: bool = False
    """Drawn from the replay buffer rather than sampled this step."""
    source: str = "online"
    """Where a stored answer came from: "pool" (RLEP's experience pool), "online" (a run's
    own rollouts) or "external" (another model's text)."""
    step: int = 0
    """The training step (or pool id) at which it entered the replay buffer."""
    temperature: float = math.nan
    """The sampling temperature of the run that sampled it (NaN: not known)."""
    run: str = ""
    checkpoint: str = ""
    """The run (its folder) that sampled it and the checkpoint that run started from."""
    score: float | None = None
    """Its checker's score, for a checker that gives one (a user's), with the format terms
    added where there are any; None: the reward is the verdict's, in the run's reward style."""
    components: tuple[tuple[str, float], ...] = ()
    """The named parts of its score, as logged (`checker_<name>`, `format_<term>`)."""
    tools: ToolUse | None = None
    """What its tool calls did, as it was sampled (None: it called none, or it was stored)."""

    @classmethod
    def sampled(cls, at: object, key: object, rollout: Rollout) -> "Answer":
        """A rollout as a generator returns it, its arrays at `key` of `at`."""
        answer = cls(at, key, rollout.response_length, rollout.finish_reason, rollout.version, rollout.earlier_tokens)
        return answer if rollout.tools is None else answer._replace(tools=rollout.tools)

    @classmethod
    def of(cls, rollout: Rollout, **facts) -> "Answer":
        """An answer whose arrays are the given rollout, here."""
        return cls.sampled(rollout, None, rollout)._replace(**facts)

    @classmethod
    def of_arrays(cls, response_ids, logprobs, reward: float = 1.0, version: int = 0, source: str = "online",
                  step: int = 0, temperature: float = math.nan, correct: bool | None = True, run: str = "",
                  checkpoint: str = "", advantage: float | None = None) -> "Answer":
        """A stored answer from its token ids and behaviour log-probs, here (read from a file,
        or made by a tool or a test); its prompt travels with its question."""
        return cls.of(Rollout(np.empty(0, np.int32), response_ids, logprobs, "", "stop", version), reward=reward,
                      source=source, step=step, temperature=temperature, correct=correct, run=run,
                      checkpoint=checkpoint, advantage=advantage)

    @property
    def verdict(self) -> str:
        return VERDICT_NAMES[self.correct]

    @property
    def policy_tokens(self) -> int:
        """Its response tokens the policy wrote: its length less its tools' outputs'."""
        return self.length - (self.tools.tokens if self.tools else 0)

    @property
    def by_reference(self) -> bool:
        """Whether its arrays are in the object store (`at` is a ref), not here."""
        ray = sys.modules.get("ray")  # (a process that never imported Ray holds no ref: a GPU check's)
        return ray is not None and isinstance(self.at, ray.ObjectRef)

    def arrays(self) -> AnswerArrays:
        """Its arrays, read from where they are: for scripts and tests (the roles read many at
        once, `answer_arrays`)."""
        return answer_arrays([self])[0]

    @property
    def response_ids(self) -> np.ndarray:
        return self.arrays().response_ids

    @property
    def logprobs(self) -> np.ndarray:
        return self.arrays().logprobs

    def __reduce__(self):
        # Only the fields up to the last that differs from its default: a fresh answer
        # crosses from its generator (and goes to the learners) without the nine fields the
        # replay buffer fills in, which would triple its bytes.
        values = list(self)
        while values and _is_default(values[-1], _ANSWER_DEFAULTS[len(values) - 1]):
            values.pop()
        return Answer, tuple(values)


_ANSWER_DEFAULTS = tuple(Answer._field_defaults.get(name) for name in Answer._fields)


def _is_default(value, default) -> bool:
    """`value` is its field's default: the same object, or an equal value of the same type
    (NaN counts as NaN)."""
    if value is default:
        return True
    if type(value) is not type(default):
        return False
    return value == default or (isinstance(value, float) and math.isnan(value) and math.isnan(default))


def answer_arrays(answers: Sequence[Answer]) -> list[AnswerArrays]:
    """Each answer's arrays, in order: the one way arrays are read. Sources held by reference are read from the object store in one call
    (each once); those here are read in place."""
    refs = list({a.at: None for a in answers if a.by_reference})
    fetched = dict(zip(refs, sys.modules["ray"].get(refs))) if refs else {}
    return [(fetched[a.at] if a.by_reference else a.at).answer_arrays(a.key) for a in answers]


class TokenSequences(Protocol):
    """Answers a forward pass can read: (prompt ids, response ids, tool masks or None) of
    each, in order. The replay shards' packed answers are such
    (`rayrep.buffer.answers.PackedAnswers`), so that the learners read them where the shards
    left them and know nothing of the buffer."""

    def sequences(self) -> tuple[Sequence[Sequence[int]], Sequence[Sequence[int]], Sequence[np.ndarray | None]]: ...


class PartFacts(NamedTuple):
    """What the driver reads of a generator's `RolloutPart`, which it sends on by reference."""

    positions: list[int]
    """The part's prompts: their positions in the generate call's prompts."""
    answers: list[list[Answer]]
    """Per prompt, its answers (where they are is filled in by the reader: the part's ref)."""
    lost_answers: int = 0
    """Answers of carried groups whose tokens were lost with their node, sampled again from
    their questions (partial rollouts; counted in a call's first part)."""


@dataclass(frozen=True)
class Group:
    """One question's answers for one training step, as records: fresh ones, then any
    replayed ones. Read per answer (`answers`, `fresh`, `replays`) or per field, in order
    (`correct`, `rewards`, ...: what the advantages are built from)."""

    prompt: Prompt
    answers: tuple[Answer, ...]
    pending_replays: int = 0
    """Stored successes planned for the group and not chosen yet (`StepPlan.choose`): they
    join it before it trains, and count as correct answers meanwhile."""

    @classmethod
    def sampled(cls, prompt: Prompt, answers: Sequence[Answer], correct: Sequence[bool],
                scores: Sequence[float | None] | None = None, components: Sequence[tuple] | None = None) -> "Group":
        """The answers sampled for `prompt` this step, with their verdicts (and their
        checker's scores and their parts, where it gives them)."""
        scores = scores if scores is not None else [None] * len(correct)
        components = components if components is not None else [()] * len(correct)
        return cls(prompt, tuple(a._replace(correct=bool(ok), score=score, components=tuple(parts))
                                 for a, ok, score, parts in zip(answers, correct, scores, components, strict=True)))

    @property
    def size(self) -> int:
        return len(self.answers)

    @property
    def correct(self) -> tuple[bool, ...]:
        return tuple(bool(a.correct) for a in self.answers)

    @property
    def replayed(self) -> tuple[bool, ...]:
        return tuple(a.replayed for a in self.answers)

    @property
    def scores(self) -> tuple[float | None, ...]:
        return tuple(a.score for a in self.answers)

    @property
    def rewards(self) -> tuple[float, ...]:
        """Each answer's reward, once the algorithm has scored the group; empty before."""
        return tuple(a.reward for a in self.answers) if self.scored else ()

    @property
    def scored(self) -> bool:
        return bool(self.answers) and all(a.reward is not None for a in self.answers)

    @property
    def advantages(self) -> tuple[float, ...]:
        """Each answer's stored advantage, where every answer keeps one (answer-level replay);
        empty: taken over the group's rewards."""
        stored = [a.advantage for a in self.answers]
        return tuple(stored) if stored and None not in stored else ()

    def with_rewards(self, rewards: Sequence[float]) -> "Group":
        """The group scored: each answer with its reward."""
        return dataclasses.replace(self, answers=tuple(
            a._replace(reward=float(r)) for a, r in zip(self.answers, rewards, strict=True)))

    def fresh(self) -> list[Answer]:
        """The answers sampled for this step."""
        return [answer for answer in self.answers if not answer.replayed]

    def replays(self) -> list[Answer]:
        """The answers drawn from the replay buffer."""
        return [answer for answer in self.answers if answer.replayed]

    @property
    def replay_count(self) -> int:
        return sum(a.replayed for a in self.answers)

    @property
    def informative(self) -> bool:
        """Some answers right and some wrong (a pending replay is a right one): the group
        carries a learning signal."""
        right = sum(bool(a.correct) for a in self.answers) + self.pending_replays
        return 0 < right < self.size + self.pending_replays

    def with_replays(self, replays: Sequence[Answer]) -> "Group":
        """This group with stored successes appended, none pending any more: each correct by
        construction, scored with the group (its stored reward and advantage not kept)."""
        joined = tuple(a._replace(replayed=True, correct=True, reward=None, advantage=None)
                       for a in replays)
        return dataclasses.replace(self, answers=self.answers + joined, pending_replays=0)


@dataclass(frozen=True)
class StepPlan:
    """What one round of a training step samples, decided before anything is generated.

    A value: an algorithm returns it from `plan` and reads it back in nothing but what it
    holds, so a second plan (a dynamic-sampling refill) cannot change the first.
    """

    requests: tuple[tuple[Prompt, int], ...]
    """(question, number of fresh rollouts to sample for it), in plan order (`build` draws the
    batch's own: `rayrep.algos.grpo.mini_batch_order`)."""
    replays: Mapping[str, tuple[Answer, ...]] = field(default_factory=dict)
    """Question id -> stored answers that join its group after generation (RLEP, ExGRPO)."""
    replay_if_at_most: int | None = None
    """Adaptive replay: a question's stored answers join its group only when at most this
    many of its fresh rollouts are correct (the group needs them); None: always."""
    choose: tuple[str, ...] = ()
    """Questions that get one stored answer chosen later, when the learners hold the GPUs
    (ExGRPO's lowest-entropy choice: `join_replays`); their groups leave the round with it
    pending."""

    @property
    def prompts(self) -> list[Prompt]:
        return [prompt for prompt, _ in self.requests]

    def split(self) -> list["StepPlan"]:
        """One plan per request, in order (partial rollouts carry a group over on its own; a
        question the sampler drew twice, across an epoch's end, is two requests)."""
        return [dataclasses.replace(self, requests=(request,),
                                    replays={uid: self.replays[uid]} if uid in self.replays else {},
                                    choose=(uid,) if uid in self.choose else ())
                for request in self.requests for uid in (request[0].uid,)]

    def complete(self, fresh: Sequence[Group]) -> list[Group]:
        """The planned groups: each question's fresh rollouts (`fresh`, in request order)
        followed by the stored answers planned for it (with `replay_if_at_most`, only where
        the fresh ones have at most that many correct)."""
        if [g.prompt.uid for g in fresh] != [p.uid for p, _ in self.requests]:
            raise ValueError("fresh groups do not match the plan's questions")
        limit, choose = self.replay_if_at_most, set(self.choose)
        return [group if limit is not None and sum(group.correct) > limit
                else dataclasses.replace(group.with_replays(self.replays.get(group.prompt.uid, ())),
                                         pending_replays=int(group.prompt.uid in choose))
                for group in fresh]


Objective = Literal["ppo", "gspo", "cispo", "sapo"]
"""The policy-gradient objective of the tokens that are not ExGRPO's shaped replay
(`rayrep.learner.loss`): PPO's clipped token ratio, GSPO's clipped sequence ratio, CISPO's
clipped and detached weight on the log-prob, SAPO's soft gate."""
OBJECTIVES: tuple[str, ...] = typing.get_args(Objective)
KLEstimator = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "kl+", "abs+", "k3+", "low_var_kl+"]
"""An estimator of KL(pi_theta || pi_ref) per token, by verl's names (`kl` is `k1`, `mse` is
`k2`, `low_var_kl` is `k3`); a `+` takes the value of the named one and the gradient of k2
(`rayrep.learner.loss.kl_penalty`)."""
KL_ESTIMATORS: tuple[str, ...] = typing.get_args(KLEstimator)

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""How per-token losses become one number (see `rayrep.learner.loss.policy_loss`)."""
AGGREGATIONS: tuple[str, ...] = typing.get_args(Aggregation)
TOKEN_SUM_AGGREGATIONS = ("seq-mean-token-sum", "seq-mean-token-sum-norm")
"""The aggregations that divide token sums by `norm_constant`."""


class SpecError(ValueError):
    """A rule of the loss's settings broken (`LossSpec`, `MismatchCorrection`): each rule is
    written once, as a text with a `{field}` for each field it ties, and named here the way
    the spec names them; the config names the same rule by its own fields and values
    (`named`: `learner.dual_clip=0.5 must be a number > 1.0, or off`)."""

    def __init__(self, owner: str, rule: str, values: Mapping[str, object]):
        self.owner, self.rule, self.values = owner, rule, dict(values)
        super().__init__(self.named({field: f"{owner}.{field.replace('__', '.')}" for field in self.values}))

    def named(self, names: Mapping[str, str], values: Mapping[str, object] | None = None) -> str:
        """The rule's text with each field as `name=value` (`names`, `values`: by field;
        default, the spec's values)."""
        values = self.values if values is None else values
        return self.rule.format(**{field: f"{names[field]}={values[field]!r}" for field in self.values})


RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2",
              "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""verl's rejection options (`rollout_rs`), by the same names: the per-token divergence of the
learner's from the engine's log-prob (k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d, d the log ratio
clamped to +-20), as it is (`token_`) or the answer's sum, mean or largest over its tokens."""
OWN_REJECTIONS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
"""rayrep's band on the ratio r (`MismatchCorrection.reject`), as the verl option of the same
statistic: r in [lower, upper] is k1 = -log r in [log(1 / upper), log(1 / lower)]."""


@dataclass(frozen=True)
class Rejection:
    """One rejection rule in verl's terms (`rollout_corr_helper.compute_rollout_rejection_mask`):
    a k1 option keeps what has ``log(lower) <= statistic <= log(upper)`` (a band on the inverse
    of the ratio, its product or its geometric mean), a k2 / k3 option what has
    ``statistic <= upper``."""

    option: str
    upper: float
    lower: float | None = None
    """k1 options only; > 0 and at most `upper`."""

    @property
    def divergence(self) -> str:
        return self.option.rsplit("_", 1)[1]

    @property
    def aggregate(self) -> str:
        """'token', 'seq_sum', 'seq_mean' or 'seq_max'."""
        return self.option.rsplit("_", 1)[0]


def parse_rejections(options: str, thresholds: str) -> tuple[Rejection, ...]:
    """verl's `rollout_rs` (options, comma-separated) and `rollout_rs_threshold` (one threshold
    for all, or one per option, comma-separated) as `Rejection`s, parsed as verl parses them
    (`_parse_rollout_rs_thresholds`): a k1 threshold is "lower_upper" or one number u (lower
    1 / u); a k2 / k3 threshold one number. A `ValueError` names what is wrong."""
    names = list(dict.fromkeys(name.strip() for name in options.split(",") if name.strip()))
    for name in names:
        if name not in RS_OPTIONS:
            raise ValueError(f"unknown rejection option {name!r}: one of {', '.join(RS_OPTIONS)}")
    if not names:
        if str(thresholds).strip():
            raise ValueError(f"a threshold ({thresholds!r}) without a rejection option to bound")
        return ()
    specs = [spec.strip() for spec in str(thresholds).split(",")] if str(thresholds).strip() else []
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(f"{len(names)} rejection option(s) ({', '.join(names)}) need one threshold or one each, "
                         f"got {thresholds!r}")
    rules = []
    for name, spec in zip(names, specs):
        try:
            numbers = [float(part) for part in spec.split("_", 1)]
        except ValueError:
            raise ValueError(f"the threshold {spec!r} of {name} is not a number (or lower_upper for a k1 option)") from None
        if any(not (value > 0 and math.isfinite(value)) for value in numbers):
            raise ValueError(f"the threshold {spec!r} of {name} must be positive and finite")
        if name.endswith("_k1"):
            lower, upper = numbers if len(numbers) == 2 else (1.0 / numbers[0], numbers[0])
            if lower > upper:
                raise ValueError(f"the threshold {spec!r} of {name}: its lower end is above its upper end")
            rules.append(Rejection(name, upper=upper, lower=lower))
        elif len(numbers) == 2:
            raise ValueError(f"the threshold {spec!r} of {name} is one number (a bound on its divergence), not lower_upper")
        else:
            rules.append(Rejection(name, upper=numbers[0]))
    return tuple(rules)


@dataclass(frozen=True)
class MismatchCorrection:
    """How the loss corrects the fresh answers for the training-inference mismatch: the
    engines' log-probs (pi_engine) against the learner's at the weights the update began
    with (pi_old), ``r_t = pi_old(y_t) / pi_engine(y_t)``, as verl's rollout correction
    (decoupled mode) defines it: truncated importance weights, rejection rules, and rayrep's
    own veto. The formulas are in `rayrep.learner.mismatch`; replayed answers keep their own
    correction (RLEP's recomputed or decoupled ratio, ExGRPO's shaping)."""

    weights: Literal["none", "token", "sequence"] = "none"
    """Each fresh token's PPO loss times min(r, weight_cap): r per token, or the product over
    the answer (verl `rollout_is`)."""
    weight_cap: float = 2.0
    """Upper truncation of the weights (verl `rollout_is_threshold`); > 0."""
    weight_lower: float | None = None
    """IcePop's weights (verl's "lower_upper" `rollout_is_threshold`): a weight outside
    [weight_lower, weight_cap] is 0, not truncated; in (0, weight_cap). None: truncated."""
    reject: Literal["none", "token", "sequence", "geometric"] = "none"
    """Tokens whose r (per token; the answer's product; its geometric mean) lies outside
    [reject_lower, reject_upper] leave the loss and its counts (verl's `token_k1`, `seq_sum_k1`,
    `seq_mean_k1` with the band inverted: `OWN_REJECTIONS`)."""
    reject_upper: float = 2.0
    """> 1."""
    reject_lower: float = 0.5
    """In (0, reject_upper)."""
    rs: tuple[Rejection, ...] = ()
    """verl's rejection rules by its own names and thresholds (`parse_rejections`); every rule,
    and `reject`, must keep a token."""
    veto: float | None = None
    """An answer with any token of r below this leaves the loss whole (verl 0.6's
    `rollout_token_veto_threshold`, which verl 0.9 has dropped); in (0, 1). None: no veto."""

    @property
    def rejections(self) -> tuple[Rejection, ...]:
        """Every rejection rule, `reject`'s band as its verl option."""
        own = ()
        if self.reject != "none":
            own = (Rejection(OWN_REJECTIONS[self.reject], upper=1.0 / self.reject_lower, lower=1.0 / self.reject_upper),)
        return own + self.rs

    @property
    def rejects(self) -> bool:
        """Whether it takes tokens out of the loss (so out of the mini-batch's counts)."""
        return bool(self.rejections) or self.veto is not None

    def __post_init__(self):
        def broken(rule: str, *fields: str) -> SpecError:
            return SpecError("MismatchCorrection", rule, {f: getattr(self, f) for f in fields})

        if self.weights not in ("none", "token", "sequence"):
            raise broken("{weights} must be 'none', 'token' or 'sequence'", "weights")
        if self.reject not in ("none", *OWN_REJECTIONS):
            raise broken("{reject} must be 'none', 'token', 'sequence' or 'geometric'", "reject")
        if not self.weight_cap > 0:
            raise broken("{weight_cap} must be > 0", "weight_cap")
        if self.weight_lower is not None and not 0 < self.weight_lower < self.weight_cap:
            raise broken("{weight_lower} must be in (0, {weight_cap}), or off", "weight_lower", "weight_cap")
        if not 0 < self.reject_lower < self.reject_upper or not self.reject_upper > 1:
            raise broken("the rejection band [{reject_lower}, {reject_upper}] must hold 1, its lower end above 0",
                         "reject_lower", "reject_upper")
        if self.veto is not None and not 0 < self.veto < 1:
            raise broken("{veto} must be in (0, 1), or off", "veto")


@dataclass(frozen=True)
class LossSpec:
    """How the learner turns log-probs into a loss; checked once, when it is built.

    Every response token is trained with one of two objectives:
    - **the policy objective** (`objective`: PPO's clipped ratio, with clip-higher and the
      dual clip for negative advantages; or GSPO, CISPO, SAPO). Fresh tokens use it, clipped
      or not (`clip_fresh`); replayed tokens use it, always clipped, unless `replay_loss` is
      "shaped".
    - **shaped** (ExGRPO): replayed tokens train with `-A * w / (w + replay_beta)`, with
      `w` the ratio to the RECORDED behaviour log-probs, never clipped.

    A KL penalty to the reference policy (`kl_coef`) adds to either.
    """

    objective: Objective = "ppo"
    """The policy objective (`rayrep.learner.loss`'s docstring has each formula)."""

    clip_low: float = 0.2
    """Ratio floor 1 - clip_low; in [0, 1)."""
    clip_high: float = 0.28
    """Ratio ceiling 1 + clip_high; >= 0 (clip-higher)."""
    dual_clip: float | None = 10.0
    """Bound c of the dual clip for negative advantages, > 1; None disables it."""
    clip_fresh: bool = True
    """Clip fresh tokens' ratio; ExGRPO's mixed phase (as its code does) leaves them unclipped."""
    replay_loss: Literal["ppo", "shaped"] = "ppo"
    """Objective of replayed tokens: the clipped PPO ratio, or ExGRPO's f(w) shaping."""
    replay_beta: float = 0.1
    """beta of the shaping f(w) = w / (w + beta); > 0."""
    agg: Aggregation = "token-mean"
    norm_constant: float | None = None
    """Divisor of token sums; set with the two '...-token-sum...' aggregations only; > 0."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts coef x the token-mean entropy (>= 0; 0 trains without)."""
    behaviour_cap: float | None = None
    """Decoupled PPO (asynchronous rollouts, replayed answers): the ratio is taken against the
    proximal policy (the learner's weights when the update began) and each PPO token's loss
    is weighted by min(pi_prox / pi_behaviour, behaviour_cap), pi_behaviour from the recorded
    log-probs; > 0. None: off (the ratio is against the old log-probs as given)."""
    correction: MismatchCorrection | None = None
    """The mismatch correction of the fresh answers; None: none (the metrics are recorded
    all the same). Its weights and `behaviour_cap` would weigh the same tokens twice: one or
    the other."""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for tokens of positive advantage (verl `tau_pos`); > 0."""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for the others (verl `tau_neg`); > 0."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy in the loss (verl `kl_loss_coef`); >= 0,
    0: no penalty (and no reference log-probs needed)."""
    kl_estimator: KLEstimator = "k3"
    """The penalty's per-token estimator (verl `kl_loss_type`; its default `low_var_kl` is k3)."""

    def __post_init__(self):
        values = {**vars(self), "correction__weights": getattr(self.correction, "weights", "none")}

        def broken(rule: str, *fields: str) -> SpecError:
            return SpecError("LossSpec", rule, {f: values[f] for f in fields})

        def number(name: str, low: float, high: float = math.inf, low_open: bool = False, off: str = "") -> None:
            value = values[name]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
            if ok:
                ok = (value > low if low_open else value >= low) and value < high
            if not ok:
                bound = f"{'>' if low_open else '>='} {low}" + (f" and < {high}" if high != math.inf else "")
                raise broken(f"{{{name}}} must be a number {bound}{off}", name)

        if self.objective not in OBJECTIVES:
            raise broken(f"{{objective}} must be one of {OBJECTIVES}", "objective")
        number("clip_low", 0.0, 1.0)
        number("clip_high", 0.0)
        if self.dual_clip is not None:
            number("dual_clip", 1.0, low_open=True, off=", or off")
            if self.objective != "ppo":
                raise broken("{dual_clip} bounds PPO's token ratio; it means nothing with {objective}: turn it off",
                             "dual_clip", "objective")
        number("sapo_tau_pos", 0.0, low_open=True)
        number("sapo_tau_neg", 0.0, low_open=True)
        number("kl_coef", 0.0)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise broken(f"{{kl_estimator}} must be one of {KL_ESTIMATORS}", "kl_estimator")
        number("replay_beta", 0.0, low_open=True)
        number("entropy_coef", 0.0)
        if self.behaviour_cap is not None:
            number("behaviour_cap", 0.0, low_open=True, off=", or off")
        if self.correction is not None and self.correction.weights != "none" and self.behaviour_cap is not None:
            raise broken("{correction__weights} and {behaviour_cap} both weigh the fresh tokens by pi_old / pi_engine: "
                         "set one of them", "correction__weights", "behaviour_cap")
        if self.replay_loss not in ("ppo", "shaped"):
            raise broken("{replay_loss} must be 'ppo' or 'shaped'", "replay_loss")
        if self.agg not in AGGREGATIONS:
            raise broken(f"{{agg}} must be one of {AGGREGATIONS}", "agg")
        if self.agg in TOKEN_SUM_AGGREGATIONS:
            if self.norm_constant is None:
                raise broken("{norm_constant} is required with {agg}", "norm_constant", "agg")
            number("norm_constant", 0.0, low_open=True)
        elif self.norm_constant is not None:
            raise broken(f"{{norm_constant}} only applies to {' and '.join(TOKEN_SUM_AGGREGATIONS)}, not {{agg}}",
                         "norm_constant", "agg")


@dataclass
class TrainBatch:
    """What the learner trains on: per-token tensors, nothing algorithm-specific.

    N sequences (prompt + response, right-padded to length L). Token t of a row is
    predicted from tokens < t; per-token tensors are indexed by the predicted token.
    """

    input_ids: "torch.Tensor"
    """[N, L] int64: prompt then response token ids, right-padded."""
    lengths: "torch.Tensor"
    """[N] int64: prompt + response length of each row (positions >= length are padding)."""
    response_mask: "torch.Tensor"
    """[N, L] bool: position t holds a response token that the loss trains on: the policy's,
    not a tool's output (the context it reads), nor padding."""
    old_logprobs: "torch.Tensor"
    """[N, L] float32: log-prob of token t under the behaviour policy (response positions)."""
    recompute_old: "torch.Tensor"
    """[N] bool: the learner replaces these rows' old log-probs with its own before updating."""
    advantages: "torch.Tensor"
    """[N] float32: one advantage per sequence."""
    replay_mask: "torch.Tensor"
    """[N] bool: replayed answer (from the buffer), not a fresh rollout."""
    prompt_index: "torch.Tensor"
    """[N] int64: question of each row; a mini-batch takes whole questions."""
    temperature: float = 1.0
    """Sampling temperature of the behaviour policy; the learner scales its logits to match."""

    @property
    def num_prompts(self) -> int:
        return int(self.prompt_index.max()) + 1 if len(self.prompt_index) else 0

    def collate(self) -> "TrainBatch":
        """The batch itself: what a `BatchRecipe` collates to (the learners collate whichever
        they are given)."""
        return self

    @classmethod
    def of_sequences(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        prompt_index: Sequence[int],
        *,
        logprobs: Sequence[Sequence[float]] | None = None,
        tool_masks: Sequence[np.ndarray | None] | None = None,
        advantages: Sequence[float] | None = None,
        recompute_old: Sequence[bool] | None = None,
        replayed: Sequence[bool] | None = None,
        temperature: float = 1.0,
        pad_id: int = 0,
    ) -> "TrainBatch":
        """Rows of prompt + response, right-padded; unset per-row fields are zeros / False.
        `tool_masks`: per row, its response tokens that a tool wrote (None: none), which
        leave `response_mask` (their log-probs are 0 here, not NaN: a masked token must not
        turn a product into NaN)."""
        import torch

        count = len(response_ids)
        lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompt_ids, response_ids)], dtype=torch.long)
        width = int(lengths.max()) if count else 1
        # Filled as numpy arrays, then wrapped: rows arrive as arrays (read-only where Ray
        # maps them in place) or lists, and numpy copies either into place.
        input_ids = np.full((count, width), pad_id, np.int64)
        response_mask = np.zeros((count, width), bool)
        old_logprobs = np.zeros((count, width), np.float32)
        for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
            start, end = len(prompt), len(prompt) + len(response)
            input_ids[row, :start] = prompt
            input_ids[row, start:end] = response
            tools = tool_masks[row] if tool_masks is not None else None
            response_mask[row, start:end] = True if tools is None else ~np.asarray(tools, bool)
            if logprobs is not None:
                old_logprobs[row, start:end] = logprobs[row]
                if tools is not None:
                    old_logprobs[row, start:end][tools] = 0.0

        def flags(values) -> "torch.Tensor":
            return torch.zeros(count, dtype=torch.bool) if values is None else torch.tensor(list(values), dtype=torch.bool)

        return cls(
            input_ids=torch.from_numpy(input_ids),
            lengths=lengths,
            response_mask=torch.from_numpy(response_mask),
            old_logprobs=torch.from_numpy(old_logprobs),
            recompute_old=flags(recompute_old),
            advantages=torch.zeros(count) if advantages is None else torch.as_tensor(advantages, dtype=torch.float32),
            replay_mask=flags(replayed),
            prompt_index=torch.tensor(list(prompt_index), dtype=torch.long),
            temperature=temperature,
        )


class BatchRow(NamedTuple):
    """One row of the learners' batch: an answer (with the advantage it trains with) and
    where it goes in the batch."""

    answer: Answer
    question: int
    """The row's question, as its place among the batch's questions (`TrainBatch.prompt_index`:
    a question's rows share its prompt, and a mini-batch takes whole questions)."""
    recompute_old: bool
    """Its "old" log-probs are the learner's before the update, not the recorded ones."""


@dataclass(frozen=True)
class BatchRecipe:
    """What the learners' batch is made of, without its arrays: one record per row, its
    answer (as the driver holds it: where its arrays are) and its place. Each
    learner rank reads the rows' arrays from the object store and collates the batch itself
    (`collate`), so that no token goes through the driver."""

    rows: tuple[BatchRow, ...]
    temperature: float = 1.0

    @property
    def advantages(self) -> tuple[float, ...]:
        return tuple(row.answer.advantage for row in self.rows)

    def collate(self) -> TrainBatch:
        """The batch: every row's arrays read (`answer_arrays`), then `TrainBatch.of_sequences`."""
        arrays = answer_arrays([row.answer for row in self.rows])
        return TrainBatch.of_sequences(
            [a.prompt_ids for a in arrays], [a.response_ids for a in arrays], [row.question for row in self.rows],
            logprobs=[a.logprobs for a in arrays], tool_masks=[a.tool_mask for a in arrays], advantages=self.advantages,
            recompute_old=[row.recompute_old for row in self.rows],
            replayed=[row.answer.replayed for row in self.rows], temperature=self.temperature)


@dataclass(frozen=True)
class StepBatch:
    """One training step, built by an algorithm from its verified groups: what to train on,
    with which loss, and what the step saw."""

    recipe: BatchRecipe
    """The learners' batch, by reference (`batch` reads and collates it here)."""
    loss: LossSpec
    groups: tuple[Group, ...]
    """The trained groups, scored (`rewards` set), in the batch's row order."""
    dropped: tuple[Group, ...] = ()
    """Verified groups left out of the batch (dynamic sampling), scored too."""
    metrics: Mapping[str, float] = field(default_factory=dict)

    @property
    def batch(self) -> TrainBatch:
        """The batch itself, its rows read in this process: for tools and tests (the training
        loop sends the learners `recipe`)."""
        return self.recipe.collate()

    @property
    def seen(self) -> tuple[Group, ...]:
        """Every group verified this step, trained or not."""
        return self.groups + self.dropped
