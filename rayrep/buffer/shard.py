"""ReplayShard: one shard of the replay buffer (a Ray actor), holding answers per question.

Storage is one flat columnar store per shard (`AnswerStore`): every answer's token ids
and behaviour log-probs in two arenas, one row of small columns per answer, and per
question only its prompt, its bucket and the row numbers of its answers. Drawing 1,024
answers of 512 questions is then a few vectorized gathers, not a Python step per answer
(which, with an array set per question, took most of a sampling call's time). Python
objects per answer would cost hundreds of bytes each; this way an answer costs its raw
arrays plus 37 bytes.

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

from rayrep.library_output import route_library_output
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

def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _flat(arrays: list, dtype) -> np.ndarray:
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
                tokens = _spans(batch.tokens, batch.offsets[rows], lengths)
                logprobs = _spans(batch.logprobs, batch.offsets[rows], lengths)
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


def _spans(array: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """array[starts[i] : starts[i] + lengths[i]] of every i, one after another.

    Slices joined by one concatenate: about three times faster than a gather by index for
    answers of hundreds of tokens, and no index array of 8 bytes per token."""
    if not len(starts):
        return np.empty(0, array.dtype)
    return np.concatenate([array[start : start + n] for start, n in zip(starts.tolist(), lengths.tolist())])


class AnswerStore:
    """A shard's answers in flat columns: token ids and log-probs in two arenas, and one row
    per answer (where its tokens start, how many, reward, version, source, step).

    Rows and tokens are only appended; an evicted or retired answer leaves a hole, and the
    store is compacted (live rows rewritten in question order) once holes outweigh what
    is live. Every array is the store's own, never a view of a call's arguments (which,
    in a Ray actor, are views of the call's whole serialized buffer)."""

    ROW_COLUMNS = {"starts": np.int64, "lengths": np.int64, "rewards": np.float32, "versions": np.int32,
                   "sources": np.int8, "steps": np.int32}
    GROWTH = 1.5
    """Capacity grows by this factor when full: each byte is copied about three times while
    a shard fills, and unused capacity is address space, not resident memory, until written."""
    COMPACT_ROWS = 65_536
    """Rows copied at a time by `compact`: memory holds the new store plus one such part."""

    def __init__(self):
        self.tokens = np.empty(0, np.int32)
        self.logprobs = np.empty(0, np.float32)
        self.columns = {name: np.empty(0, dtype) for name, dtype in self.ROW_COLUMNS.items()}
        self.used_tokens = 0
        self.used_rows = 0
        self.dead_tokens = 0
        self.dead_rows = 0

    @property
    def live_tokens(self) -> int:
        return self.used_tokens - self.dead_tokens

    @property
    def live_rows(self) -> int:
        return self.used_rows - self.dead_rows

    @property
    def nbytes(self) -> int:
        """Bytes of the live answers: 8 per token (id, log-prob), 29 per row."""
        return 8 * self.live_tokens + sum(np.dtype(t).itemsize for t in self.ROW_COLUMNS.values()) * self.live_rows

    def reserve(self, tokens: int, rows: int) -> None:
        """Room for `tokens` more tokens and `rows` more answers."""
        def grown(array: np.ndarray, used: int, need: int) -> np.ndarray:
            if used + need <= len(array):
                return array
            bigger = np.empty(max(used + need, int(len(array) * self.GROWTH)), array.dtype)
            bigger[:used] = array[:used]
            return bigger

        self.tokens = grown(self.tokens, self.used_tokens, tokens)
        self.logprobs = grown(self.logprobs, self.used_tokens, tokens)
        self.columns = {name: grown(array, self.used_rows, rows) for name, array in self.columns.items()}

    def append(self, batch: PackedAnswers, rows: np.ndarray) -> np.ndarray:
        """Copy the answers `rows` of a packed batch in; returns their row numbers here."""
        lengths = batch.offsets[rows + 1] - batch.offsets[rows]
        offsets = _offsets(lengths)
        self.reserve(int(offsets[-1]), len(rows))
        span = slice(self.used_tokens, self.used_tokens + int(offsets[-1]))
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
            source = slice(batch.offsets[rows[0]], batch.offsets[rows[-1] + 1])  # consecutive answers: one slice
            self.tokens[span], self.logprobs[span] = batch.tokens[source], batch.logprobs[source]
        else:
            self.tokens[span] = _spans(batch.tokens, batch.offsets[rows], lengths)
            self.logprobs[span] = _spans(batch.logprobs, batch.offsets[rows], lengths)
        new = np.arange(self.used_rows, self.used_rows + len(rows))
        values = {"starts": self.used_tokens + offsets[:-1], "lengths": lengths, "rewards": batch.rewards[rows],
                  "versions": batch.versions[rows], "sources": batch.sources[rows], "steps": batch.steps[rows]}
        for name, array in self.columns.items():
            array[new] = values[name]
        self.used_tokens += int(offsets[-1])
        self.used_rows += len(rows)
        return new

    def append_question(self, entry: QuestionAnswers) -> np.ndarray:
        """Copy one question's answers in (a restored snapshot); returns their row numbers."""
        batch = PackedAnswers(uids=[], counts=np.array([len(entry)], np.int64), offsets=entry.offsets,
                              tokens=entry.tokens, logprobs=entry.logprobs, rewards=entry.rewards,
                              versions=entry.versions, sources=entry.sources, steps=entry.steps)
        return self.append(batch, np.arange(len(entry)))

    def drop(self, rows: np.ndarray) -> None:
        """Rows no question holds any more (evicted, retired): holes until the next compaction."""
        self.dead_rows += len(rows)
        self.dead_tokens += int(self.columns["lengths"][rows].sum())

    def tokens_of(self, row: int) -> np.ndarray:
        start = self.columns["starts"][row]
        return self.tokens[start : start + self.columns["lengths"][row]]

    def gather(self, uids: list[str], counts, rows: np.ndarray, prompts: list[np.ndarray] | None = None) -> PackedAnswers:
        """The answers `rows`, `counts[q]` of them for question `uids[q]` in turn, packed."""
        starts, lengths = self.columns["starts"][rows], self.columns["lengths"][rows]
        packed = PackedAnswers(
            uids=list(uids), counts=np.asarray(counts, np.int64), offsets=_offsets(lengths),
            tokens=_spans(self.tokens, starts, lengths), logprobs=_spans(self.logprobs, starts, lengths),
            rewards=self.columns["rewards"][rows],
            versions=self.columns["versions"][rows], sources=self.columns["sources"][rows],
            steps=self.columns["steps"][rows],
        )
        if prompts is not None:
            packed.prompt_offsets = _offsets(np.array([len(p) for p in prompts], np.int64))
            packed.prompts = _flat(prompts, np.int32)
        return packed

    def compact(self, questions: list[StoredQuestion]) -> None:
        """Rewrite the live rows, each question's together in the given order, without holes;
        each question's row numbers change to their new places."""
        sizes = np.array([len(q.rows) for q in questions], np.int64)
        rows = np.concatenate([q.rows for q in questions]) if questions else np.empty(0, np.int64)
        starts, lengths = self.columns["starts"][rows], self.columns["lengths"][rows]
        offsets = _offsets(lengths)
        tokens, logprobs = np.empty(offsets[-1], np.int32), np.empty(offsets[-1], np.float32)
        for first in range(0, len(rows), self.COMPACT_ROWS):
            part = slice(first, first + self.COMPACT_ROWS)
            into = slice(offsets[first], offsets[min(first + self.COMPACT_ROWS, len(rows))])
            tokens[into], logprobs[into] = _spans(self.tokens, starts[part], lengths[part]), _spans(self.logprobs, starts[part], lengths[part])
        self.tokens, self.logprobs = tokens, logprobs
        self.columns = {name: array[rows] for name, array in self.columns.items()}
        self.columns["starts"] = offsets[:-1].copy()
        self.used_tokens, self.used_rows = int(offsets[-1]), len(rows)
        self.dead_tokens = self.dead_rows = 0
        for question, first in zip(questions, _offsets(sizes)[:-1].tolist()):
            question.rows = np.arange(first, first + len(question.rows))

    def question_view(self, question: StoredQuestion) -> QuestionAnswers:
        """A question's answers as views of the store (its rows must be consecutive, as after
        `compact`): what a snapshot reads."""
        first, count = (int(question.rows[0]), len(question.rows)) if len(question.rows) else (0, 0)
        rows = slice(first, first + count)
        starts, lengths = self.columns["starts"][rows], self.columns["lengths"][rows]
        entry = QuestionAnswers(question.prompt_ids)
        if count:
            entry.tokens = self.tokens[starts[0] : starts[-1] + lengths[-1]]
            entry.logprobs = self.logprobs[starts[0] : starts[-1] + lengths[-1]]
            entry.offsets = np.append(starts, starts[-1] + lengths[-1]) - starts[0]
        entry.rewards, entry.versions = self.columns["rewards"][rows], self.columns["versions"][rows]
        entry.sources, entry.steps = self.columns["sources"][rows], self.columns["steps"][rows]
        entry.bucket = question.bucket
        return entry


class StoredQuestion:
    """One question in a shard: its prompt, its bucket, and its answers' rows in the store."""

    __slots__ = ("prompt_ids", "rows", "bucket")

    def __init__(self, prompt_ids: np.ndarray, bucket: int = -1):
        # Always a copy: inside a Ray actor the argument is a read-only view of the whole
        # call's serialized buffer, and keeping the view would pin all of it (every answer
        # of the add call) in the object store for as long as the question lives.
        self.prompt_ids = np.array(prompt_ids, dtype=np.int32)
        self.rows = np.empty(0, np.int64)
        """Row numbers of its answers in the shard's `AnswerStore`, oldest first."""
        self.bucket = bucket
        """Latest count of correct answers out of K (ExGRPO); -1 until set."""

    def __len__(self) -> int:
        return len(self.rows)


class ReplayShard:
    """One shard's questions; see the module docstring."""

    def __init__(self, max_answers_per_question: int, seed: int = 0):
        route_library_output()
        self.cap = max_answers_per_question
        """Stored answers kept per question, the oldest evicted beyond it; 0: no cap."""
        self.store = AnswerStore()
        self.questions: dict[str, StoredQuestion] = {}
        self.retired: set[str] = set()
        self.rng = random.Random(seed)
        self.evicted = 0
        self.in_id_order = True
        """Whether each question's answers lie together in the store, questions in id order
        (after a compaction, until the next write): what `export` needs."""

    # ------------------------------------------------------------------ writes

    def _holds(self, entry: StoredQuestion, ids: np.ndarray) -> bool:
        lengths = self.store.columns["lengths"][entry.rows]
        return any(np.array_equal(self.store.tokens_of(row), ids) for row in entry.rows[lengths == len(ids)].tolist())

    def add_packed(self, batch: PackedAnswers, dedup: bool = False) -> int:
        """Store answers packed with their prompts; returns how many were stored.

        Retired questions take nothing. With `dedup`, an answer whose token ids are already
        stored under its question is skipped.
        """
        taken: list[tuple[str, int, np.ndarray]] = []  # (question, its index in the batch, rows of the batch)
        first = 0
        for q, (uid, count) in enumerate(zip(batch.uids, batch.counts.tolist())):
            rows, first = np.arange(first, first + count), first + count
            if uid in self.retired or not count:
                continue
            if dedup:
                entry, fresh, seen = self.questions.get(uid), [], []
                for i in rows.tolist():
                    ids = batch.tokens[batch.offsets[i] : batch.offsets[i + 1]]
                    if (entry is None or not self._holds(entry, ids)) and not any(np.array_equal(ids, s) for s in seen):
                        fresh.append(i)
                        seen.append(ids)
                rows = np.array(fresh, np.int64)
            if len(rows):
                taken.append((uid, q, rows))
        if not taken:
            return 0
        sizes = np.array([len(rows) for _, _, rows in taken], np.int64)
        stored_rows = self.store.append(batch, np.concatenate([rows for _, _, rows in taken]))
        for (uid, q, _), first, count in zip(taken, _offsets(sizes)[:-1].tolist(), sizes.tolist()):
            entry = self.questions.get(uid)
            if entry is None:
                entry = self.questions[uid] = StoredQuestion(batch.prompt(q))
            entry.rows = np.concatenate([entry.rows, stored_rows[first : first + count]])
            evict = len(entry) - self.cap if self.cap else 0
            if evict > 0:
                self.store.drop(entry.rows[:evict])
                entry.rows = entry.rows[evict:]
                self.evicted += evict
        self.in_id_order = False
        self._compact_if_holey()
        return int(sizes.sum())

    def _compact(self) -> None:
        self.store.compact([self.questions[uid] for uid in sorted(self.questions)])
        self.in_id_order = True

    def _compact_if_holey(self) -> None:
        if self.store.dead_tokens > self.store.live_tokens or self.store.dead_rows > self.store.live_rows:
            self._compact()

    def set_buckets(self, counts: dict[str, int]) -> None:
        """Record each question's latest number of correct answers (its ExGRPO bucket)."""
        for uid, k in counts.items():
            if uid in self.questions:
                self.questions[uid].bucket = k

    def retire(self, uids: list[str]) -> int:
        """Remove questions forever: their answers go, and later adds are refused."""
        removed = 0
        for uid in uids:
            entry = self.questions.pop(uid, None)
            if entry is not None:
                self.store.drop(entry.rows)
                removed += 1
            self.retired.add(uid)
        self._compact_if_holey()
        return removed

    def apply(self, items: PackedAnswers, dedup: bool, buckets: dict[str, int], retire: list[str]) -> dict:
        """One round trip for a step's writes: add, then set buckets, then retire; returns stats."""
        stored = self.add_packed(items, dedup)
        self.set_buckets(buckets)
        self.retire(list(retire))
        return {"stored": stored, **self.stats()}

    # ------------------------------------------------------------------ reads

    def _rows(self, entries: list[StoredQuestion | None]) -> np.ndarray:
        """The rows of every given question, one question after another."""
        held = [entry.rows for entry in entries if entry is not None]
        return np.concatenate(held) if held else np.empty(0, np.int64)

    def sample_packed(self, uids: list[str], wanted, seed: int | None = None) -> PackedAnswers:
        """Up to `wanted[q]` stored answers of question `uids[q]`, uniformly without
        replacement (what it has when a question has fewer: never placeholders), packed.

        Ids and counts as a list of strings and an array cross a Ray call about three times
        faster than a list of (id, count) tuples."""
        rng = np.random.default_rng(seed if seed is not None else self.rng.getrandbits(63))
        entries = [self.questions.get(uid) for uid in uids]
        sizes = np.array([0 if entry is None else len(entry.rows) for entry in entries], np.int64)
        counts = np.minimum(np.maximum(np.asarray(wanted, np.int64).reshape(-1), 0), sizes)
        # Uniform without replacement, all questions at once: order each question's answers
        # by random keys in [0, 1) (sorting q + key keeps the questions apart, in order) and
        # keep its first counts[q].
        question = np.repeat(np.arange(len(sizes)), sizes)
        order = np.argsort(question + rng.random(len(question)))
        starts = _offsets(sizes)
        keep = np.arange(len(question)) - starts[question] < counts[question]
        return self.store.gather(uids, counts, self._rows(entries)[order[keep]])

    def stored_answers(self, uids: list[str]) -> tuple[list[tuple[str, int]], PackedAnswers]:
        """((question id, answer count) of those held here, in order; all their answers packed
        with their prompts). Two values so that a caller can read the small index and pass
        the answers on by reference (`.options(num_returns=2)`)."""
        present = [uid for uid in dict.fromkeys(uids) if uid in self.questions]
        entries = [self.questions[uid] for uid in present]
        packed = self.store.gather(present, [len(e) for e in entries], self._rows(entries),
                                   prompts=[e.prompt_ids for e in entries])
        return [(uid, len(entry)) for uid, entry in zip(present, entries)], packed

    def answers_at(self, uids: list[str], positions: list[int]) -> PackedAnswers:
        """Answer `positions[q]` (oldest first) of question `uids[q]`, packed."""
        rows = np.array([self.questions[uid].rows[i] for uid, i in zip(uids, positions)], np.int64)
        return self.store.gather(uids, [1] * len(uids), rows)

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
        """Counts; `bytes`: the live answers' arrays (8 bytes per token, 29 per answer) plus
        each question's prompt and row numbers (holes left by evictions not counted)."""
        answers = self.store.live_rows
        stats = {
            "questions": len(self.questions),
            "answers": answers,
            "retired": len(self.retired),
            "evicted": self.evicted,
            "bytes": self.store.nbytes + sum(e.prompt_ids.nbytes + e.rows.nbytes for e in self.questions.values()),
            "buckets": self.bucket_sizes(),
        }
        if now_step is not None and answers:
            ages = now_step - self.store.columns["steps"][self._rows(list(self.questions.values()))]
            stats["age_mean"], stats["age_max"] = float(ages.mean()), int(ages.max())
        return stats

    def pid(self) -> int:
        """The process holding this shard (whether it still answers: `rayrep.cluster.placement.responds`)."""
        return os.getpid()

    # ------------------------------------------------------------------ snapshot

    def export(self) -> dict:
        """Everything, as plain arrays in a stable order (question id, then age).

        The store is compacted in that order first, so that each question's answers are
        consecutive and go out as views, not copies."""
        if not self.in_id_order:
            self._compact()
        uids = sorted(self.questions)
        return {
            "questions": [(uid, self.store.question_view(self.questions[uid])) for uid in uids],
            "retired": sorted(self.retired),
            "evicted": self.evicted,
        }

    def restore(self, questions: list[tuple[str, QuestionAnswers]], retired: list[str], evicted: int) -> None:
        # Copied into a new store: arrays that arrive through Ray are read-only views of the
        # call's serialized buffer (all of the restored content), which can then be freed.
        # Question by question into reserved room: one append of everything would first
        # concatenate it all, twice the content in memory at once.
        self.store = AnswerStore()
        self.store.reserve(sum(len(entry.tokens) for _, entry in questions), sum(len(entry) for _, entry in questions))
        self.questions = {}
        for uid, entry in questions:
            stored = self.questions[uid] = StoredQuestion(entry.prompt_ids, entry.bucket)
            stored.rows = self.store.append_question(entry)
        self.retired = set(retired)
        self.evicted = evicted
        self.in_id_order = [uid for uid, _ in questions] == sorted(uid for uid, _ in questions)


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteReplayShard = ray.remote(ReplayShard)
