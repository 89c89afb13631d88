"""ReplayShard: one shard of the replay buffer (a Ray actor), holding answers per question.

Storage is columnar per question: one int32 array of all its answers' token ids, one
float32 array of their behaviour log-probs, offsets, and small per-answer metadata
arrays. Python objects per answer would cost hundreds of bytes each; this way a
question costs a fixed few hundred bytes plus its raw arrays.

Answers cross between the client and the shards packed (`PackedAnswers`: a few flat
arrays per call), never as two small arrays per answer: Ray spends tens of microseconds
on each array it (de)serializes, which made sampling 512 questions' replays take 40 ms.

It serves both replay methods:
- RLEP: `sample_packed` draws M stored successes of given questions uniformly without
  replacement (what it has when a question has fewer than M: never placeholders).
- ExGRPO: questions carry the latest number of correct answers k out of K (their
  bucket); `sample_questions` takes given numbers of questions per bucket, uniformly
  without replacement; `retire` removes a question forever.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import ray

from rayrep.types import Rollout

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
            offsets=_offsets(lengths),
            tokens=_flat([a.response_ids for a in answers], np.int32),
            logprobs=_flat([a.logprobs for a in answers], np.float32),
            rewards=np.array([a.reward for a in answers], np.float32),
            versions=np.array([a.version for a in answers], np.int32),
            sources=np.array([SOURCES.index(a.source) for a in answers], np.int8),
            steps=np.array([a.step for a in answers], np.int32),
        )
        if items and all(prompt is not None for _, prompt, _ in items):
            prompts = [np.asarray(prompt) for _, prompt, _ in items]
            packed.prompt_offsets = _offsets(np.array([len(p) for p in prompts], np.int64))
            packed.prompts = _flat(prompts, np.int32)
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

    @classmethod
    def gather(cls, uids: list[str], counts: list[int], picks: list[tuple[QuestionAnswers, int]],
               prompts: list[np.ndarray] | None = None) -> PackedAnswers:
        """Pack answer i of each (question, i) pick, `counts[q]` picks for question q in turn."""
        tokens, logprobs, lengths = [], [], []
        for entry, i in picks:
            start, end = entry.offsets[i], entry.offsets[i + 1]
            tokens.append(entry.tokens[start:end])
            logprobs.append(entry.logprobs[start:end])
            lengths.append(end - start)
        packed = cls(
            uids=list(uids),
            counts=np.asarray(counts, np.int64),
            offsets=_offsets(np.array(lengths, np.int64)),
            tokens=np.concatenate(tokens) if tokens else np.empty(0, np.int32),
            logprobs=np.concatenate(logprobs) if logprobs else np.empty(0, np.float32),
            rewards=np.array([entry.rewards[i] for entry, i in picks], np.float32),
            versions=np.array([entry.versions[i] for entry, i in picks], np.int32),
            sources=np.array([entry.sources[i] for entry, i in picks], np.int8),
            steps=np.array([entry.steps[i] for entry, i in picks], np.int32),
        )
        if prompts is not None:
            packed.prompt_offsets = _offsets(np.array([len(p) for p in prompts], np.int64))
            packed.prompts = _flat(prompts, np.int32)
        return packed


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _flat(arrays: list, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype) for a in arrays]) if arrays else np.empty(0, dtype)


class QuestionAnswers:
    """All stored answers of one question, oldest first, in flat arrays."""

    ARRAYS = ("prompt_ids", "tokens", "logprobs", "offsets", "rewards", "versions", "sources", "steps")
    __slots__ = ARRAYS + ("bucket",)

    def __init__(self, prompt_ids: np.ndarray):
        # Always a copy: inside a Ray actor the argument is a read-only view of the whole
        # call's serialized buffer, and keeping the view would pin all of it (every answer
        # of the add call) in the object store for as long as the question lives.
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

    def contains(self, response_ids: np.ndarray) -> bool:
        lengths = np.diff(self.offsets)
        for i in np.nonzero(lengths == len(response_ids))[0]:
            if np.array_equal(self.tokens[self.offsets[i] : self.offsets[i + 1]], response_ids):
                return True
        return False

    def extend_rows(self, batch: PackedAnswers, rows: range | list[int], cap: int) -> int:
        """Append the given answers (rows) of a packed batch, then evict the oldest beyond `cap`
        (0: no cap).

        Every array is a new one: nothing stored is a view of the batch (which, in a Ray
        actor, is the call's serialized buffer)."""
        if len(rows):
            if isinstance(rows, range):  # one contiguous run of answers: slices, no gather
                start, end = batch.offsets[rows.start], batch.offsets[rows.stop]
                tokens, logprobs = [batch.tokens[start:end]], [batch.logprobs[start:end]]
                lengths = np.diff(batch.offsets[rows.start : rows.stop + 1])
                rows = slice(rows.start, rows.stop)
            else:
                spans = [(batch.offsets[i], batch.offsets[i + 1]) for i in rows]
                tokens = [batch.tokens[start:end] for start, end in spans]
                logprobs = [batch.logprobs[start:end] for start, end in spans]
                lengths = np.array([end - start for start, end in spans], np.int64)
                rows = np.asarray(rows, np.int64)
            self.tokens = np.concatenate([self.tokens, *tokens])
            self.logprobs = np.concatenate([self.logprobs, *logprobs])
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

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self.ARRAYS)


class ReplayShard:
    """One shard's questions; see the module docstring."""

    def __init__(self, max_answers_per_question: int, seed: int = 0):
        self.cap = max_answers_per_question
        """Stored answers kept per question, the oldest evicted beyond it; 0: no cap."""
        self.questions: dict[str, QuestionAnswers] = {}
        self.retired: set[str] = set()
        self.rng = random.Random(seed)
        self.evicted = 0

    # ------------------------------------------------------------------ writes

    def add_packed(self, batch: PackedAnswers, dedup: bool = False) -> int:
        """Store answers packed with their prompts; returns how many were stored.

        Retired questions take nothing. With `dedup`, an answer whose token ids are already
        stored under its question is skipped.
        """
        stored, first = 0, 0
        for q, (uid, count) in enumerate(zip(batch.uids, batch.counts.tolist())):
            rows, first = range(first, first + count), first + count
            if uid in self.retired:
                continue
            entry = self.questions.get(uid)
            if entry is None:
                entry = self.questions[uid] = QuestionAnswers(batch.prompt(q))
            if dedup:
                fresh, seen = [], []
                for i in rows:
                    ids = batch.tokens[batch.offsets[i] : batch.offsets[i + 1]]
                    if not entry.contains(ids) and not any(np.array_equal(ids, s) for s in seen):
                        fresh.append(i)
                        seen.append(ids)
                rows = fresh if len(fresh) < len(rows) else rows
            self.evicted += entry.extend_rows(batch, rows, self.cap)
            stored += len(rows)
            if len(entry) == 0:
                del self.questions[uid]
        return stored

    def set_buckets(self, counts: dict[str, int]) -> None:
        """Record each question's latest number of correct answers (its ExGRPO bucket)."""
        for uid, k in counts.items():
            if uid in self.questions:
                self.questions[uid].bucket = k

    def retire(self, uids: list[str]) -> int:
        """Remove questions forever: their answers go, and later adds are refused."""
        removed = 0
        for uid in uids:
            removed += self.questions.pop(uid, None) is not None
            self.retired.add(uid)
        return removed

    def apply(self, items: PackedAnswers, dedup: bool, buckets: dict[str, int], retire: list[str]) -> dict:
        """One round trip for a step's writes: add, then set buckets, then retire; returns stats."""
        stored = self.add_packed(items, dedup)
        self.set_buckets(buckets)
        self.retire(list(retire))
        return {"stored": stored, **self.stats()}

    # ------------------------------------------------------------------ reads

    def sample_packed(self, uids: list[str], wanted, seed: int | None = None) -> PackedAnswers:
        """Up to `wanted[q]` stored answers of question `uids[q]`, uniformly without
        replacement (what it has when a question has fewer: never placeholders), packed.

        Ids and counts as a list of strings and an array cross a Ray call about three times
        faster than a list of (id, count) tuples."""
        rng = np.random.default_rng(seed if seed is not None else self.rng.getrandbits(63))
        entries = [self.questions.get(uid) for uid in uids]
        sizes = np.array([0 if entry is None else len(entry) for entry in entries], np.int64)
        counts = np.minimum(np.maximum(np.asarray(wanted, np.int64).reshape(-1), 0), sizes)
        # Uniform without replacement, all questions at once: order each question's answers
        # by random keys in [0, 1) (sorting q + key keeps the questions apart, in order) and
        # keep its first counts[q].
        question = np.repeat(np.arange(len(sizes)), sizes)
        order = np.argsort(question + rng.random(len(question)))
        starts = _offsets(sizes)
        keep = np.arange(len(question)) - starts[question] < counts[question]
        kept = question[keep]
        picks = [(entries[q], i) for q, i in zip(kept.tolist(), (order[keep] - starts[kept]).tolist())]
        return PackedAnswers.gather(uids, counts, picks)

    def stored_answers(self, uids: list[str]) -> tuple[list[tuple[str, int]], PackedAnswers]:
        """((question id, answer count) of those held here, in order; all their answers packed
        with their prompts). Two values so that a caller can read the small index and pass
        the answers on by reference (`.options(num_returns=2)`)."""
        present = [uid for uid in dict.fromkeys(uids) if uid in self.questions]
        entries = [self.questions[uid] for uid in present]
        picks = [(entry, i) for entry in entries for i in range(len(entry))]
        packed = PackedAnswers.gather(present, [len(e) for e in entries], picks, prompts=[e.prompt_ids for e in entries])
        return [(uid, len(entry)) for uid, entry in zip(present, entries)], packed

    def answers_at(self, uids: list[str], positions: list[int]) -> PackedAnswers:
        """Answer `positions[q]` (oldest first) of question `uids[q]`, packed."""
        entries = [self.questions[uid] for uid in uids]
        return PackedAnswers.gather(uids, [1] * len(uids), list(zip(entries, positions)))

    def bucket_sizes(self, exclude: list[str] = ()) -> dict[int, int]:
        """Questions per bucket (those in `exclude` not counted)."""
        left_out = set(exclude)
        sizes: dict[int, int] = {}
        for uid, entry in self.questions.items():
            if entry.bucket >= 0 and uid not in left_out:
                sizes[entry.bucket] = sizes.get(entry.bucket, 0) + 1
        return sizes

    def sample_questions(self, per_bucket: dict[int, int], seed: int | None = None, exclude: list[str] = ()) -> list[str]:
        """`per_bucket[k]` questions of bucket k each, uniformly without replacement, none in `exclude`."""
        rng = random.Random(seed) if seed is not None else self.rng
        left_out = set(exclude)
        members: dict[int, list[str]] = {}
        for uid, entry in self.questions.items():
            if entry.bucket in per_bucket and uid not in left_out:
                members.setdefault(entry.bucket, []).append(uid)
        chosen = []
        for k in sorted(per_bucket):
            # In id order, not the order questions arrived in: a shard restored from a
            # snapshot (a resumed run) then draws exactly what the original one would have.
            pool = sorted(members.get(k, []))
            chosen += rng.sample(pool, min(per_bucket[k], len(pool)))
        return chosen

    def stats(self, now_step: int | None = None) -> dict:
        answers = sum(len(e) for e in self.questions.values())
        stats = {
            "questions": len(self.questions),
            "answers": answers,
            "retired": len(self.retired),
            "evicted": self.evicted,
            "bytes": sum(e.nbytes for e in self.questions.values()),
            "buckets": self.bucket_sizes(),
        }
        if now_step is not None and answers:
            ages = np.concatenate([now_step - e.steps for e in self.questions.values()])
            stats["age_mean"], stats["age_max"] = float(ages.mean()), int(ages.max())
        return stats

    def pid(self) -> int:
        """The process holding this shard (whether it still answers: `rayrep.placement.responds`)."""
        return os.getpid()

    # ------------------------------------------------------------------ snapshot

    def export(self) -> dict:
        """Everything, as plain arrays in a stable order (question id, then age)."""
        uids = sorted(self.questions)
        return {
            "questions": [(uid, self.questions[uid]) for uid in uids],
            "retired": sorted(self.retired),
            "evicted": self.evicted,
        }

    def restore(self, questions: list[tuple[str, QuestionAnswers]], retired: list[str], evicted: int) -> None:
        # Arrays that arrive through Ray are read-only views of the call's serialized buffer
        # (all of the restored content): copy them, so that the buffer can be freed.
        for _, entry in questions:
            for name in QuestionAnswers.ARRAYS:
                array = getattr(entry, name)
                if array.base is not None:
                    setattr(entry, name, array.copy())
        self.questions = dict(questions)
        self.retired = set(retired)
        self.evicted = evicted


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteReplayShard = ray.remote(ReplayShard)
