"""ReplayShard: one shard of the replay buffer (a Ray actor), holding answers per question.

Storage is columnar per question: one int32 array of all its answers' token ids, one
float32 array of their behaviour log-probs, offsets, and small per-answer metadata
arrays. Python objects per answer would cost hundreds of bytes each; this way a
question costs a fixed few hundred bytes plus its raw arrays.

It serves both replay methods:
- RLEP: `sample_answers` draws M stored successes of given questions uniformly without
  replacement (what it has when a question has fewer than M: never placeholders).
- ExGRPO: questions carry the latest number of correct answers k out of K (their
  bucket); `sample_questions` takes given numbers of questions per bucket, uniformly
  without replacement; `retire` removes a question forever.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import ray

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


class QuestionAnswers:
    """All stored answers of one question, oldest first, in flat arrays."""

    __slots__ = ("prompt_ids", "tokens", "logprobs", "offsets", "rewards", "versions", "sources", "steps", "bucket")

    def __init__(self, prompt_ids: np.ndarray):
        self.prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
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

    def answer(self, i: int) -> Answer:
        start, end = self.offsets[i], self.offsets[i + 1]
        return Answer(self.tokens[start:end].copy(), self.logprobs[start:end].copy(), float(self.rewards[i]),
                      int(self.versions[i]), SOURCES[self.sources[i]], int(self.steps[i]))

    def contains(self, response_ids: np.ndarray) -> bool:
        lengths = np.diff(self.offsets)
        for i in np.nonzero(lengths == len(response_ids))[0]:
            if np.array_equal(self.tokens[self.offsets[i] : self.offsets[i + 1]], response_ids):
                return True
        return False

    def extend(self, answers: list[Answer], cap: int) -> int:
        """Append answers, then evict the oldest beyond `cap`; returns how many were evicted."""
        if answers:
            lengths = [len(a.response_ids) for a in answers]
            self.tokens = np.concatenate([self.tokens] + [np.asarray(a.response_ids, np.int32) for a in answers])
            self.logprobs = np.concatenate([self.logprobs] + [np.asarray(a.logprobs, np.float32) for a in answers])
            self.offsets = np.concatenate([self.offsets, self.offsets[-1] + np.cumsum(lengths)])
            self.rewards = np.concatenate([self.rewards, np.array([a.reward for a in answers], np.float32)])
            self.versions = np.concatenate([self.versions, np.array([a.version for a in answers], np.int32)])
            self.sources = np.concatenate([self.sources, np.array([SOURCES.index(a.source) for a in answers], np.int8)])
            self.steps = np.concatenate([self.steps, np.array([a.step for a in answers], np.int32)])
        evict = len(self) - cap
        if evict > 0:
            cut = self.offsets[evict]
            self.tokens, self.logprobs = self.tokens[cut:].copy(), self.logprobs[cut:].copy()
            self.offsets = self.offsets[evict:] - cut
            self.rewards, self.versions = self.rewards[evict:].copy(), self.versions[evict:].copy()
            self.sources, self.steps = self.sources[evict:].copy(), self.steps[evict:].copy()
        return max(0, evict)

    @property
    def nbytes(self) -> int:
        arrays = (self.prompt_ids, self.tokens, self.logprobs, self.offsets, self.rewards, self.versions, self.sources, self.steps)
        return sum(a.nbytes for a in arrays)


class ReplayShard:
    """One shard's questions; see the module docstring."""

    def __init__(self, max_answers_per_question: int, seed: int = 0):
        self.cap = max_answers_per_question
        self.questions: dict[str, QuestionAnswers] = {}
        self.retired: set[str] = set()
        self.rng = random.Random(seed)
        self.evicted = 0

    # ------------------------------------------------------------------ writes

    def add(self, items: list[tuple[str, np.ndarray, list[Answer]]], dedup: bool = False) -> int:
        """Store answers: items of (question id, prompt ids, answers). Returns answers stored.

        Retired questions take nothing. With `dedup`, an answer whose token ids are already
        stored under its question is skipped.
        """
        stored = 0
        for uid, prompt_ids, answers in items:
            if uid in self.retired:
                continue
            entry = self.questions.get(uid)
            if entry is None:
                entry = self.questions[uid] = QuestionAnswers(prompt_ids)
            if dedup:
                fresh, seen = [], []
                for a in answers:
                    ids = np.asarray(a.response_ids, np.int32)
                    if not entry.contains(ids) and not any(np.array_equal(ids, s) for s in seen):
                        fresh.append(a)
                        seen.append(ids)
                answers = fresh
            self.evicted += entry.extend(answers, self.cap)
            stored += len(answers)
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

    def apply(self, items=(), dedup: bool = False, buckets: dict | None = None, retire=()) -> dict:
        """One round trip for a step's writes: add, then set buckets, then retire; returns stats."""
        stored = self.add(list(items), dedup) if items else 0
        self.set_buckets(buckets or {})
        self.retire(list(retire))
        return {"stored": stored, **self.stats()}

    # ------------------------------------------------------------------ reads

    def sample_answers(self, requests: list[tuple[str, int]], seed: int | None = None) -> dict[str, list[Answer]]:
        """Up to `count` stored answers per question, uniformly without replacement."""
        rng = random.Random(seed) if seed is not None else self.rng
        out = {}
        for uid, count in requests:
            entry = self.questions.get(uid)
            if entry is None or count <= 0:
                out[uid] = []
                continue
            picks = rng.sample(range(len(entry)), min(count, len(entry)))
            out[uid] = [entry.answer(i) for i in picks]
        return out

    def all_answers(self, uids: list[str]) -> dict[str, tuple[np.ndarray, list[Answer]]]:
        """(prompt ids, every stored answer) of each question (ExGRPO's entropy selection)."""
        return {
            uid: (self.questions[uid].prompt_ids.copy(), [self.questions[uid].answer(i) for i in range(len(self.questions[uid]))])
            for uid in uids
            if uid in self.questions
        }

    def bucket_sizes(self) -> dict[int, int]:
        sizes: dict[int, int] = {}
        for entry in self.questions.values():
            if entry.bucket >= 0:
                sizes[entry.bucket] = sizes.get(entry.bucket, 0) + 1
        return sizes

    def sample_questions(self, per_bucket: dict[int, int], seed: int | None = None) -> list[str]:
        """`per_bucket[k]` questions of bucket k each, uniformly without replacement."""
        rng = random.Random(seed) if seed is not None else self.rng
        members: dict[int, list[str]] = {}
        for uid, entry in self.questions.items():
            if entry.bucket in per_bucket:
                members.setdefault(entry.bucket, []).append(uid)
        chosen = []
        for k in sorted(per_bucket):
            pool = members.get(k, [])
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
        self.questions = dict(questions)
        self.retired = set(retired)
        self.evicted = evicted


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteReplayShard = ray.remote(ReplayShard)
