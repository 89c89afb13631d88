"""The answers that travel: one stored answer (`Answer`), a call's answers packed into a few
flat arrays (`PackedAnswers`), and one question's answers as they go to and from snapshot
and pool files (`QuestionAnswers`).

Answers cross between the client and the shards packed, never as two small arrays per
answer: Ray spends tens of microseconds on each array it (de)serializes, which made
sampling 512 questions' replays take 40 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rayrep.types import Group, Rollout

SOURCES = ("pool", "online")
"""Where an answer came from: an offline experience pool (RLEP) or this run (ExGRPO)."""


@dataclass
class Answer:
    """One stored answer, as it enters or leaves the buffer."""

    response_ids: np.ndarray
    """int32 [T] token ids of the answer."""
    logprobs: np.ndarray
    """float32 [T] behaviour log-probs (NaN where unknown, e.g. imported text-only pools)."""
    reward: float
    version: int = 0
    source: str = "online"
    step: int = 0
    """Training step (or pool id) at which it entered the buffer."""

    @classmethod
    def fresh_successes(cls, group: Group, step: int) -> list[Answer]:
        """The verified-correct answers sampled for a scored group this step (not its
        replayed ones), as answers that enter the buffer at `step`."""
        return [
            cls(np.array(r.response_ids, np.int32), np.array(r.logprobs, np.float32), reward, r.version, "online", step)
            for r, ok, replayed, reward in zip(group.rollouts, group.correct, group.replayed, group.rewards)
            if ok and not replayed
        ]

    def rollout(self, prompt_ids: list[int]) -> Rollout:
        """This answer replayed: a rollout of the question whose prompt tokens are `prompt_ids`."""
        return Rollout(
            prompt_ids=list(prompt_ids),
            response_ids=self.response_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            text="",  # replayed answers were verified when they were stored
            finish_reason="stop",
            version=self.version,
        )


@dataclass
class PackedAnswers:
    """Answers of several questions in flat arrays, grouped by question, in order."""

    uids: list[str]
    counts: np.ndarray
    """int64 [Q]: how many answers each question has here."""
    offsets: np.ndarray
    """int64 [N + 1]: answer i's tokens are tokens[offsets[i] : offsets[i + 1]]."""
    tokens: np.ndarray
    logprobs: np.ndarray
    rewards: np.ndarray
    versions: np.ndarray
    sources: np.ndarray
    """int8 [N]: index into SOURCES."""
    steps: np.ndarray
    prompt_offsets: np.ndarray | None = None
    """int64 [Q + 1] (with prompts): question q's prompt is prompts[prompt_offsets[q] : prompt_offsets[q + 1]]."""
    prompts: np.ndarray | None = None

    @classmethod
    def pack(cls, items: list[tuple[str, np.ndarray | None, list[Answer]]]) -> PackedAnswers:
        """Pack (question id, prompt ids or None, answers) items."""
        answers = [a for _, _, group in items for a in group]
        lengths = np.array([len(a.response_ids) for a in answers], np.int64)
        logprob_lengths = np.array([len(a.logprobs) for a in answers], np.int64)
        if not np.array_equal(lengths, logprob_lengths):
            bad = int(np.nonzero(lengths != logprob_lengths)[0][0])
            for uid, _, group in items:  # name the question and the answer
                if bad < len(group):
                    raise ValueError(f"question {uid!r}, answer {bad}: {len(group[bad].response_ids)} token ids "
                                     f"but {len(group[bad].logprobs)} log-probs")
                bad -= len(group)
        packed = cls(
            uids=[uid for uid, _, _ in items],
            counts=np.array([len(group) for _, _, group in items], np.int64),
            offsets=cumulative_offsets(lengths),
            tokens=flat_array([a.response_ids for a in answers], np.int32),
            logprobs=flat_array([a.logprobs for a in answers], np.float32),
            rewards=np.array([a.reward for a in answers], np.float32),
            versions=np.array([a.version for a in answers], np.int32),
            sources=np.array([SOURCES.index(a.source) for a in answers], np.int8),
            steps=np.array([a.step for a in answers], np.int32),
        )
        if items and all(prompt is not None for _, prompt, _ in items):
            prompts = [np.asarray(prompt) for _, prompt, _ in items]
            packed.prompt_offsets = cumulative_offsets(np.array([len(p) for p in prompts], np.int64))
            packed.prompts = flat_array(prompts, np.int32)
        return packed

    def prompt(self, q: int) -> np.ndarray:
        return self.prompts[self.prompt_offsets[q] : self.prompt_offsets[q + 1]]

    def unpack(self) -> dict[str, list[Answer]]:
        """Answers by question; their arrays are views of the packed ones, never of a shard's storage."""
        return {uid: answers for _, uid, answers in self._groups()}

    def sequences(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(prompt ids, response ids) of every answer, in order (packed with prompts): what a
        forward pass over the stored answers needs."""
        prompts = [self.prompt(q) for q, count in enumerate(self.counts.tolist()) for _ in range(count)]
        responses = [self.tokens[self.offsets[i] : self.offsets[i + 1]] for i in range(len(self.rewards))]
        return prompts, responses

    def _groups(self):
        offsets, rewards, versions = self.offsets.tolist(), self.rewards.tolist(), self.versions.tolist()
        sources, steps = self.sources.tolist(), self.steps.tolist()
        first = 0
        for q, (uid, count) in enumerate(zip(self.uids, self.counts.tolist())):
            yield q, uid, [
                Answer(self.tokens[offsets[i] : offsets[i + 1]], self.logprobs[offsets[i] : offsets[i + 1]], rewards[i],
                       versions[i], SOURCES[sources[i]], steps[i])
                for i in range(first, first + count)
            ]
            first += count

def cumulative_offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def flat_array(arrays: list, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype) for a in arrays]) if arrays else np.empty(0, dtype)


class QuestionAnswers:
    """All stored answers of one question, oldest first, in flat arrays: how snapshot and
    pool files hand questions to a shard and take them from it."""

    ARRAYS = ("prompt_ids", "tokens", "logprobs", "offsets", "rewards", "versions", "sources", "steps")
    __slots__ = ARRAYS + ("bucket",)

    def __init__(self, prompt_ids: np.ndarray):
        self.prompt_ids = np.array(prompt_ids, dtype=np.int32)
        self.tokens = np.empty(0, dtype=np.int32)
        self.logprobs = np.empty(0, dtype=np.float32)
        self.offsets = np.zeros(1, dtype=np.int64)
        self.rewards = np.empty(0, dtype=np.float32)
        self.versions = np.empty(0, dtype=np.int32)
        self.sources = np.empty(0, dtype=np.int8)
        self.steps = np.empty(0, dtype=np.int32)
        self.bucket = -1
        """Latest count of correct answers out of K (ExGRPO); -1 until set."""

    def __len__(self) -> int:
        return len(self.rewards)

    def extend_rows(self, batch: PackedAnswers, rows: range | list[int], cap: int) -> int:
        """Append the given answers (rows) of a packed batch, then evict the oldest beyond `cap`
        (0: no cap); returns how many were evicted."""
        if len(rows):
            if isinstance(rows, range):  # one contiguous run of answers: slices, no gather
                start, end = batch.offsets[rows.start], batch.offsets[rows.stop]
                tokens, logprobs = batch.tokens[start:end], batch.logprobs[start:end]
                lengths = np.diff(batch.offsets[rows.start : rows.stop + 1])
                rows = slice(rows.start, rows.stop)
            else:
                rows = np.asarray(rows, np.int64)
                lengths = batch.offsets[rows + 1] - batch.offsets[rows]
                tokens = spans(batch.tokens, batch.offsets[rows], lengths)
                logprobs = spans(batch.logprobs, batch.offsets[rows], lengths)
            self.tokens = np.concatenate([self.tokens, tokens])
            self.logprobs = np.concatenate([self.logprobs, logprobs])
            self.offsets = np.concatenate([self.offsets, self.offsets[-1] + np.cumsum(lengths)])
            self.rewards = np.concatenate([self.rewards, batch.rewards[rows]])
            self.versions = np.concatenate([self.versions, batch.versions[rows]])
            self.sources = np.concatenate([self.sources, batch.sources[rows]])
            self.steps = np.concatenate([self.steps, batch.steps[rows]])
        evict = len(self) - cap if cap else 0
        if evict > 0:
            cut = self.offsets[evict]
            self.tokens, self.logprobs = self.tokens[cut:].copy(), self.logprobs[cut:].copy()
            self.offsets = self.offsets[evict:] - cut
            self.rewards, self.versions = self.rewards[evict:].copy(), self.versions[evict:].copy()
            self.sources, self.steps = self.sources[evict:].copy(), self.steps[evict:].copy()
        return max(0, evict)


def spans(array: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """array[starts[i] : starts[i] + lengths[i]] of every i, one after another.

    Slices joined by one concatenate: about three times faster than a gather by index for
    answers of hundreds of tokens, and no index array of 8 bytes per token."""
    if not len(starts):
        return np.empty(0, array.dtype)
    return np.concatenate([array[start : start + n] for start, n in zip(starts.tolist(), lengths.tolist())])
