"""How answers travel to and from the replay buffer: a call's answers packed into a few flat
arrays (`PackedAnswers`), what a drawing client reads of a draw whose answers stay on the
shards (`DrawnFacts`), and one question's answers as they go to and from snapshot and pool
files (`QuestionAnswers`). An answer itself is `rayrep.types.Answer` everywhere.

Answers cross between the client and the shards packed, never as two small arrays per
answer: Ray spends tens of microseconds on each array it (de)serializes, about 40 ms for
the replays of 512 questions sent that way.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rayrep.types import Answer, AnswerArrays, Group, answer_arrays

SOURCES = ("pool", "online", "external")
"""Where an answer came from: an offline experience pool (RLEP), a run's own rollouts
(ExGRPO, a growing pool, a shared pool's runs), or another model's traces (imported text)."""

VERDICTS = {"wrong": 0, "correct": 1, "unchecked": -1}
"""The verifier's verdict on a stored answer; `unchecked`: imported as its writer verified it."""

FACTS = np.dtype([("reward", np.float32), ("version", np.int32), ("source", np.int8), ("step", np.int32),
                  ("temperature", np.float32), ("verdict", np.int8), ("origin", np.int64), ("advantage", np.float32)])
"""What is known of each stored answer besides its tokens, one record per answer: one array
to gather, pack and send instead of one per field (each array crossing a Ray call costs tens
of microseconds). `origin`: the id (`origin_id`) of the run and checkpoint that sampled it,
named in the origin table that travels beside the records; `advantage`: the one it was
trained with when it was stored (answer-level replay; NaN where not known)."""

Origins = dict[int, tuple[str, str]]
"""origin id -> (run, checkpoint): the names behind the `origin` field of answers' facts."""


def origin_id(run: str, checkpoint: str) -> int:
    """A stable id of (run, checkpoint), the same in every process and shard (0: unknown), so
    that answers keep their origin as one integer wherever they are copied."""
    if not run and not checkpoint:
        return 0
    digest = hashlib.blake2b(f"{run}\0{checkpoint}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1 or 1


@dataclass(frozen=True)
class Origin:
    """Who samples a run's answers: the run (its folder), the checkpoint it started from (its
    policy version counts the updates since), and the sampling temperature."""

    run: str = ""
    checkpoint: str = ""
    temperature: float = math.nan


def as_stored(answers: Sequence[Answer], step: int, origin: Origin = Origin()) -> list[Answer]:
    """Answers sampled this step, scored, as they enter the buffer at `step`: a run's own
    ("online"), named by who sampled them; their arrays stay where they are (the shard that
    takes them reads them there)."""
    unscored = next((a for a in answers if a.reward is None), None)
    if unscored is not None:
        raise ValueError(f"an answer of policy version {unscored.version} is not scored yet (no reward to store)")
    return [a._replace(source="online", step=step, temperature=origin.temperature, run=origin.run,
                                checkpoint=origin.checkpoint) for a in answers]


def fresh_successes(group: Group, step: int, origin: Origin = Origin()) -> list[Answer]:
    """The verified-correct answers sampled for a scored group this step (not its replayed
    ones), as they enter the buffer at `step`."""
    return as_stored([a for a in group.fresh() if a.correct], step, origin)


_VERDICT_CODES = {True: VERDICTS["correct"], False: VERDICTS["wrong"], None: VERDICTS["unchecked"]}
_CORRECT = {code: correct for correct, code in _VERDICT_CODES.items()}
_NO_ORIGIN = ("", "")


@dataclass(frozen=True)
class DrawLimit:
    """Which stored answers a draw may use: none sampled more than `max_lag` policy versions
    before the drawing run's current `version` (-1: any age), and, with `others_only`, none
    of the drawing run's own (`run`). What it leaves out is counted (`held_back`), never
    silently used or silently missing."""

    version: int = 0
    max_lag: int = -1
    run: str = ""
    others_only: bool = False

    @property
    def limits(self) -> bool:
        return self.max_lag >= 0 or self.others_only

    def allows(self, facts: np.ndarray, origins: Origins) -> np.ndarray:
        """Which of the answers (their `FACTS` records, their origins' names) a draw may use."""
        keep = np.ones(len(facts), bool)
        if self.max_lag >= 0:
            keep &= facts["version"] >= self.version - self.max_lag
        if self.others_only:
            own = [origin for origin, (run, _) in origins.items() if run == self.run]
            keep &= ~np.isin(facts["origin"], np.array(own, np.int64))
        return keep


@dataclass
class PackedAnswers:
    """Answers of several questions in flat arrays, grouped by question, in order."""

    uids: list[str]
    counts: np.ndarray
    """int64 [Q]: how many answers each question has here."""
    offsets: np.ndarray
    """int64 [N + 1]: answer i's tokens are tokens[offsets[i] : offsets[i + 1]]."""
    tokens: np.ndarray | None
    """int32 [offsets[-1]]; None in a draw's facts (`facts_only`) and until `pending` is read."""
    logprobs: np.ndarray | None
    """float32 [offsets[-1]]; None: not carried (a draw for a caller that does not read
    them), unpacked as NaN, unknown."""
    facts: np.ndarray
    """FACTS [N]: each answer's reward, version, source, step, temperature, verdict, origin."""
    origins: Origins = field(default_factory=dict)
    """The names of the origins `facts` refers to."""
    tool_mask: np.ndarray | None = None
    """bool [offsets[-1]]: the tokens a tool's output wrote; None: no answer here called a
    tool (and until `pending` is read)."""
    prompt_offsets: np.ndarray | None = None
    """int64 [Q + 1] (with prompts): question q's prompt is prompts[prompt_offsets[q] : prompt_offsets[q + 1]]."""
    prompts: np.ndarray | None = None
    held_back: int = 0
    """Stored answers of these questions that the draw's `DrawLimit` left out."""
    pending: list[Answer] | None = None
    """Where each answer's arrays are, when they were packed by reference (`resolve` reads them)."""

    @classmethod
    def pack(cls, items: list[tuple[str, np.ndarray | None, list[Answer]]]) -> PackedAnswers:
        """Pack (question id, prompt ids or None, answers) items. Answers held by reference
        (`Answer.by_reference`: all of them or none) are packed without their arrays, which
        the shard that takes them reads (`resolve`); the arrays of those here are packed."""
        answers = [a for _, _, group in items for a in group]
        by_reference = [a.by_reference for a in answers]
        if any(by_reference) and not all(by_reference):
            raise ValueError("answers to pack are all held by reference or none are")
        lengths = np.array([a.length for a in answers], np.int64)
        arrays = None if any(by_reference) else answer_arrays(answers)
        if arrays is not None:
            logprob_lengths = np.array([len(a.logprobs) for a in arrays], np.int64)
            if not np.array_equal(lengths, logprob_lengths):
                bad = int(np.nonzero(lengths != logprob_lengths)[0][0])
                tokens, logprobs = lengths[bad], logprob_lengths[bad]
                for uid, _, group in items:  # name the question and the answer
                    if bad < len(group):
                        raise ValueError(f"question {uid!r}, answer {bad}: {tokens} token ids but {logprobs} log-probs")
                    bad -= len(group)
        origins: Origins = {}
        facts = np.empty(len(answers), FACTS)
        for i, a in enumerate(answers):
            origin = origin_id(a.run, a.checkpoint)
            if origin:
                origins[origin] = (a.run, a.checkpoint)
            facts[i] = (math.nan if a.reward is None else a.reward, a.version, SOURCES.index(a.source), a.step,
                        a.temperature, _VERDICT_CODES[a.correct], origin,
                        math.nan if a.advantage is None else a.advantage)
        packed = cls(
            uids=[uid for uid, _, _ in items],
            counts=np.array([len(group) for _, _, group in items], np.int64),
            offsets=cumulative_offsets(lengths),
            tokens=None if arrays is None else flat_array([a.response_ids for a in arrays], np.int32),
            logprobs=None if arrays is None else flat_array([a.logprobs for a in arrays], np.float32),
            tool_mask=None if arrays is None else flat_tool_mask(arrays),
            facts=facts,
            origins=origins,
            pending=answers if arrays is None else None,
        )
        if items and all(prompt is not None for _, prompt, _ in items):
            prompts = [np.asarray(prompt) for _, prompt, _ in items]
            packed.prompt_offsets = cumulative_offsets(np.array([len(p) for p in prompts], np.int64))
            packed.prompts = flat_array(prompts, np.int32)
        return packed

    def prompt(self, q: int) -> np.ndarray:
        """Question `q`'s prompt ids (none where packed without prompts)."""
        if self.prompts is None:
            return np.empty(0, np.int32)
        return self.prompts[self.prompt_offsets[q] : self.prompt_offsets[q + 1]]

    def resolve(self) -> None:
        """Read the arrays of answers packed by reference (`pending`) from where they are:
        what a shard does with a write before it stores it."""
        if self.pending is None:
            return
        arrays = answer_arrays(self.pending)
        lengths = np.array([len(a.response_ids) for a in arrays], np.int64)
        announced = np.diff(self.offsets)
        if not np.array_equal(lengths, announced):
            bad = int(np.nonzero(lengths != announced)[0][0])
            raise ValueError(f"answer {bad} of question batch {self.uids[:3]}...: {lengths[bad]} tokens where it was "
                             f"announced with {int(announced[bad])}")
        self.tokens = flat_array([a.response_ids for a in arrays], np.int32)
        self.logprobs = flat_array([a.logprobs for a in arrays], np.float32)
        self.tool_mask = flat_tool_mask(arrays)
        self.pending = None

    def facts_only(self) -> DrawnFacts:
        """What a drawing client reads of these answers when their arrays go on by reference."""
        return DrawnFacts(self.uids, self.counts, self.offsets, self.facts, self.origins, self.held_back)

    def answer_arrays(self, key: int) -> AnswerArrays:
        """Answer `key`'s arrays, its log-probs NaN where not carried (`rayrep.types.AnswerSource`:
        a drawn answer replayed by reference)."""
        start, end = int(self.offsets[key]), int(self.offsets[key + 1])
        question = int(np.searchsorted(np.cumsum(self.counts), key, side="right"))
        logprobs = self.logprobs[start:end] if self.logprobs is not None else np.full(end - start, np.nan, np.float32)
        return AnswerArrays(self.prompt(question), self.tokens[start:end], logprobs, self.answer_tool_mask(start, end))

    def tool_mask_or_zeros(self) -> np.ndarray:
        """`tool_mask`, or all False where it is None (no tool wrote any token here)."""
        return self.tool_mask if self.tool_mask is not None else np.zeros(len(self.tokens), np.bool_)

    def answer_tool_mask(self, start: int, end: int) -> np.ndarray | None:
        """The tool mask of the tokens [start, end), or None where no tool wrote any of them."""
        if self.tool_mask is None:
            return None
        mask = self.tool_mask[start:end]
        return mask if mask.any() else None

    def unpack(self) -> dict[str, list[Answer]]:
        """Answers by question, their arrays here: these packed ones (`Answer.at`), never a
        shard's storage."""
        return self.facts_only().unpack(at=self)

    def sequences(self) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray | None]]:
        """(prompt ids, response ids, tool masks) of every answer, in order (packed with
        prompts): what a forward pass over the stored answers needs
        (`rayrep.types.TokenSequences`)."""
        prompts = [self.prompt(q) for q, count in enumerate(self.counts.tolist()) for _ in range(count)]
        spans = list(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist()))
        return (prompts, [self.tokens[start:end] for start, end in spans],
                [self.answer_tool_mask(start, end) for start, end in spans])


@dataclass
class DrawnFacts:
    """Drawn answers without their arrays (`PackedAnswers.facts_only`): what the driver reads
    of a draw whose answers go on to the learners by reference."""

    uids: list[str]
    counts: np.ndarray
    offsets: np.ndarray
    facts: np.ndarray
    origins: Origins
    held_back: int = 0

    def unpack(self, at: object) -> dict[str, list[Answer]]:
        """Answers by question, each saying where its arrays are: answer i of `at`, the
        `PackedAnswers` these are the facts of (a ref to it, or it)."""
        lengths = np.diff(self.offsets).tolist()
        names = [self.origins.get(origin, _NO_ORIGIN) for origin in self.facts["origin"].tolist()]
        answers = [
            Answer(at, i, length, "stop", version, correct=_CORRECT[verdict], reward=reward,
                   advantage=None if math.isnan(advantage) else advantage, source=SOURCES[source], step=step,
                   temperature=temperature, run=run, checkpoint=checkpoint)
            for i, (length, (reward, version, source, step, temperature, verdict, _, advantage), (run, checkpoint))
            in enumerate(zip(lengths, self.facts.tolist(), names))  # facts: tuples in FACTS' field order
        ]
        return by_question(self.uids, self.counts, answers)


def by_question(uids: list[str], counts: np.ndarray, answers: list[Answer]) -> dict[str, list[Answer]]:
    firsts = cumulative_offsets(counts).tolist()
    return {uid: answers[first:last] for uid, first, last in zip(uids, firsts, firsts[1:])}


def cumulative_offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def flat_array(arrays: list, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype) for a in arrays]) if arrays else np.empty(0, dtype)


def flat_tool_mask(arrays: list[AnswerArrays]) -> np.ndarray | None:
    """The answers' tool masks as one flat array, or None where none called a tool."""
    if all(a.tool_mask is None for a in arrays):
        return None
    return flat_array([np.zeros(len(a.response_ids), bool) if a.tool_mask is None else a.tool_mask for a in arrays],
                      np.bool_)


class QuestionAnswers:
    """All stored answers of one question, oldest first, in flat arrays: how snapshot and
    pool files hand questions to a shard and take them from it."""

    ARRAYS = ("prompt_ids", "tokens", "logprobs", "tool_mask", "offsets", "facts")
    __slots__ = ARRAYS + ("bucket",)

    def __init__(self, prompt_ids: np.ndarray):
        self.prompt_ids = np.array(prompt_ids, dtype=np.int32)
        self.tokens = np.empty(0, dtype=np.int32)
        self.logprobs = np.empty(0, dtype=np.float32)
        self.tool_mask = np.empty(0, dtype=np.bool_)
        self.offsets = np.zeros(1, dtype=np.int64)
        self.facts = np.empty(0, dtype=FACTS)
        self.bucket = -1
        """Latest count of correct answers out of K (ExGRPO); -1 until set."""

    def __len__(self) -> int:
        return len(self.facts)

    def packed(self, uid: str, origins: Origins) -> PackedAnswers:
        """Its answers packed as question `uid`'s (views of its arrays; `origins`: their names)."""
        return PackedAnswers(uids=[uid], counts=np.array([len(self)], np.int64), offsets=self.offsets,
                             tokens=self.tokens, logprobs=self.logprobs, facts=self.facts,
                             tool_mask=self.tool_mask if self.tool_mask.any() else None,
                             origins={o: origins[o] for o in np.unique(self.facts["origin"]).tolist() if o in origins})

    def extend_rows(self, batch: PackedAnswers, rows: range | list[int], cap: int) -> int:
        """Append the given answers (rows) of a packed batch, then evict the oldest beyond `cap`
        (0: no cap); returns how many were evicted."""
        if len(rows):
            batch_mask = batch.tool_mask_or_zeros()
            if isinstance(rows, range):  # one contiguous run of answers: slices, no gather
                start, end = batch.offsets[rows.start], batch.offsets[rows.stop]
                tokens, logprobs, mask = batch.tokens[start:end], batch.logprobs[start:end], batch_mask[start:end]
                lengths = np.diff(batch.offsets[rows.start : rows.stop + 1])
                rows = slice(rows.start, rows.stop)
            else:
                rows = np.asarray(rows, np.int64)
                lengths = batch.offsets[rows + 1] - batch.offsets[rows]
                tokens = spans(batch.tokens, batch.offsets[rows], lengths)
                logprobs = spans(batch.logprobs, batch.offsets[rows], lengths)
                mask = spans(batch_mask, batch.offsets[rows], lengths)
            self.tokens = np.concatenate([self.tokens, tokens])
            self.logprobs = np.concatenate([self.logprobs, logprobs])
            self.tool_mask = np.concatenate([self.tool_mask, mask])
            self.offsets = np.concatenate([self.offsets, self.offsets[-1] + np.cumsum(lengths)])
            self.facts = np.concatenate([self.facts, batch.facts[rows]])
        evict = len(self) - cap if cap else 0
        if evict > 0:
            cut = self.offsets[evict]
            self.tokens, self.logprobs = self.tokens[cut:].copy(), self.logprobs[cut:].copy()
            self.tool_mask = self.tool_mask[cut:].copy()
            self.offsets = self.offsets[evict:] - cut
            self.facts = self.facts[evict:].copy()
        return max(0, evict)


def spans(array: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """array[starts[i] : starts[i] + lengths[i]] of every i, one after another.

    Slices joined by one concatenate: about three times faster than a gather by index for
    answers of hundreds of tokens, and no index array of 8 bytes per token."""
    if not len(starts):
        return np.empty(0, array.dtype)
    return np.concatenate([array[start : start + n] for start, n in zip(starts.tolist(), lengths.tolist())])
