"""ReplayShard: one shard of the replay buffer (a Ray actor), holding answers per question.

Storage is one flat columnar store per shard (`rayrep.buffer.store`); answers travel
packed (`rayrep.buffer.answers`).

A shard knows no algorithm. It takes writes (add answers, file questions in integer
buckets, retire questions forever, evict answers by age), answers reads by key (a
question's answers, an answer by serial number, the buckets' sizes), snapshots and
restores itself, and runs an algorithm's draw where the answers are (`draw`: RLEP's
uniform draw, ExGRPO's bucketed one and answer-level replay's race live under
`rayrep.algos.sampling`).
"""

from __future__ import annotations

import os
from bisect import bisect_left, insort
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from rayrep.buffer.answers import SOURCES, DrawLimit, DrawnFacts, PackedAnswers, cumulative_offsets
from rayrep.buffer.store import AnswerStore, StoredQuestion
from rayrep.library_output import route_library_output


class BucketIndex:
    """The ids of a shard's questions in each bucket, each bucket's kept sorted as questions
    move: a bucket's size, and a uniform draw from it in id order (a shard restored from a
    snapshot must draw what the original would have), without a pass over the shard."""

    def __init__(self):
        self.members: dict[int, list[str]] = {}

    def move(self, uid: str, old: int, new: int) -> None:
        """Question `uid` leaves bucket `old` for bucket `new` (-1: none)."""
        if old == new:
            return
        if old >= 0:
            members = self.members[old]
            del members[bisect_left(members, uid)]
        if new >= 0:
            insort(self.members.setdefault(new, []), uid)

    def sizes(self) -> dict[int, int]:
        return {k: len(members) for k, members in self.members.items() if members}

    def sample(self, rng: np.random.Generator, k: int, count: int, excluded: list[str]) -> list[str]:
        """Up to `count` ids of bucket `k` uniformly without replacement, in a random order,
        none of `excluded` (members of bucket k): indexes drawn into the bucket's sorted ids
        without the excluded ones, each moved past the excluded positions before it."""
        members = self.members.get(k, [])
        skipped = np.sort(np.array([bisect_left(members, uid) for uid in excluded], np.int64))
        left = len(members) - len(skipped)
        picks = rng.choice(left, size=min(count, left), replace=False)
        picks += np.searchsorted(skipped - np.arange(len(skipped)), picks, side="right")
        return [members[i] for i in picks.tolist()]


class ReplayShard:
    """One shard's questions; see the module docstring."""

    def __init__(self, max_answers_per_question: int):
        route_library_output()
        self.cap = max_answers_per_question
        """Stored answers kept per question, the oldest evicted beyond it; 0: no cap."""
        self.store = AnswerStore()
        self.questions: dict[str, StoredQuestion] = {}
        self.names: list[str] = []
        """Question ids by their number (`StoredQuestion.number`)."""
        self.kept: dict = {}
        """What draws made over two calls keep between them (`keep`); forgotten at every write."""
        self.buckets = BucketIndex()
        self.retired: set[str] = set()
        self.evicted = 0
        self.in_id_order = True
        """Whether each question's answers lie together in the store, questions in id order
        (after a compaction, until the next write): what `export` needs."""
        self.version = 0
        """Writes that changed something (each `apply` call that stored, moved or retired
        anything): the shard's version, named by its snapshots."""

    # ------------------------------------------------------------------ writes

    def _holds(self, entry: StoredQuestion, ids: np.ndarray) -> bool:
        lengths = self.store.columns["lengths"][entry.rows]
        return any(np.array_equal(self.store.tokens_of(row), ids) for row in entry.rows[lengths == len(ids)].tolist())

    def apply(self, items: PackedAnswers, dedup: bool, buckets: dict[str, int], retire: list[str],
              evict: tuple[int, int] | None = None) -> dict:
        """One round trip for a step's writes, and the shard's only write: add the answers
        (packed with their prompts; a retired question takes nothing, and with `dedup` an
        answer whose token ids are already stored under its question is skipped), then set
        each question's latest number of correct answers (its ExGRPO bucket), then retire
        questions forever (their answers go, later adds are refused), then evict answers by
        age (`_evict_older`); returns stats."""
        stored = self._take(items, dedup, buckets, retire, evict)
        return {"stored": stored, **self.stats()}

    def _take(self, items: PackedAnswers | None, dedup: bool, buckets: dict[str, int], retire: list[str],
              evict: tuple[int, int] | None = None) -> int:
        """A caller's write (`apply`): `_write` here; a pool's shard journals it."""
        return self._write(items, dedup, buckets, retire, evict)

    def _write(self, items: PackedAnswers | None, dedup: bool, buckets: dict[str, int], retire: list[str],
               evict: tuple[int, int] | None = None) -> int:
        """Add, set buckets, retire, evict; one more version if anything changed. Returns answers
        stored. Answers sent by reference are read first, from where the generators left them."""
        if items is not None:
            items.resolve()
        self.kept.clear()  # their rows may move
        stored = self._add(items, dedup) if items is not None else 0
        moved = self._set_buckets(buckets)
        retired = self._retire(list(retire))
        evicted = self._evict_older(tuple(evict) if evict is not None else None)
        if stored or moved or retired or evicted:
            self.version += 1
        return stored

    def _add(self, batch: PackedAnswers, dedup: bool) -> int:
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
        entries = [self.questions.get(uid) or self._new_question(uid, batch.prompt(q)) for uid, q, _ in taken]
        stored_rows = self.store.append(batch, np.concatenate([rows for _, _, rows in taken]),
                                        np.repeat([entry.number for entry in entries], sizes).astype(np.int32))
        for entry, first, count in zip(entries, cumulative_offsets(sizes)[:-1].tolist(), sizes.tolist()):
            entry.rows = np.concatenate([entry.rows, stored_rows[first : first + count]])
            evict = len(entry) - self.cap if self.cap else 0
            if evict > 0:
                self.store.drop(entry.rows[:evict])
                entry.rows = entry.rows[evict:]
                self.evicted += evict
        self.in_id_order = False
        self._compact_if_holey()
        return int(sizes.sum())

    def _new_question(self, uid: str, prompt_ids: np.ndarray, bucket: int = -1) -> StoredQuestion:
        entry = self.questions[uid] = StoredQuestion(prompt_ids, len(self.names), bucket)
        self.names.append(uid)
        return entry

    def _evict_older(self, evict: tuple[int, int] | None) -> int:
        """Evict the answers of origin `evict[0]` sampled before policy version `evict[1]`
        (answer-level replay's age bound: a run evicts only what it sampled, by its own
        versions); a question left with no answer and no bucket goes. Returns answers evicted."""
        if evict is None:
            return 0
        origin, before = evict
        rows = self.store.live()
        facts = self.store.columns["facts"]  # field by field, as `_race` reads them
        old = rows[(facts["origin"][rows] == origin) & (facts["version"][rows] < before)]
        if not len(old):
            return 0
        owners = self.store.columns["owners"][old]
        self.store.drop(old)
        for number in np.unique(owners).tolist():
            uid = self.names[number]
            entry = self.questions[uid]
            entry.rows = entry.rows[self.store.columns["owners"][entry.rows] >= 0]
            if not len(entry.rows) and entry.bucket < 0:
                del self.questions[uid]
        self.evicted += len(old)
        self._compact_if_holey()
        return len(old)

    def _compact(self) -> None:
        self.kept.clear()  # their rows move
        self.store.compact([self.questions[uid] for uid in sorted(self.questions)])
        self.in_id_order = True

    def _compact_if_holey(self) -> None:
        if self.store.dead_tokens > self.store.live_tokens or self.store.dead_rows > self.store.live_rows:
            self._compact()

    def _set_buckets(self, counts: dict[str, int]) -> int:
        """Questions moved to another bucket."""
        moved = 0
        for uid, k in counts.items():
            entry = self.questions.get(uid)
            if entry is not None and entry.bucket != k:
                self.buckets.move(uid, entry.bucket, k)
                entry.bucket = k
                moved += 1
        return moved

    def _retire(self, uids: list[str]) -> int:
        """Questions newly retired."""
        retired = 0
        for uid in uids:
            entry = self.questions.pop(uid, None)
            if entry is not None:
                self.store.drop(entry.rows)
                self.buckets.move(uid, entry.bucket, -1)
            retired += uid not in self.retired
            self.retired.add(uid)
        if retired:
            self._compact_if_holey()
        return retired

    # ------------------------------------------------------------------ reads

    def _rows(self, entries: list[StoredQuestion | None]) -> np.ndarray:
        """The rows of every given question, one question after another."""
        held = [entry.rows for entry in entries if entry is not None]
        return np.concatenate(held) if held else np.empty(0, np.int64)

    def usable(self, uids: list[str], limit: DrawLimit | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """(rows of the questions `uids` that `limit` lets a draw use, one question after
        another; how many each question has (0: none, or not held here); how many the limit
        held back)."""
        entries = [self.questions.get(uid) for uid in uids]
        sizes = np.array([0 if entry is None else len(entry.rows) for entry in entries], np.int64)
        rows = self._rows(entries)
        if limit is None or not limit.limits:
            return rows, sizes, 0
        keep = limit.allows(self.store.columns["facts"][rows], self.store.origins)
        question = np.repeat(np.arange(len(entries)), sizes)
        return rows[keep], np.bincount(question[keep], minlength=len(entries)).astype(np.int64), int((~keep).sum())

    def pack(self, uids: list[str], counts, rows: np.ndarray, logprobs: bool = True) -> PackedAnswers:
        """The answers `rows`, `counts[q]` of them for question `uids[q]` in turn, packed with
        the questions' prompts; without their log-probs where `logprobs` is false (they are
        half of the bytes)."""
        prompts = [entry.prompt_ids if (entry := self.questions.get(uid)) is not None else np.empty(0, np.int32)
                   for uid in uids]
        return self.store.gather(uids, counts, rows, prompts=prompts, logprobs=logprobs)

    def numbers(self, uids: list[str]) -> np.ndarray:
        """The numbers (the store's `owners` column) of those of the questions `uids` held here."""
        return np.array([self.questions[uid].number for uid in uids if uid in self.questions], np.int32)

    def draw(self, draw: Callable[..., Any], *args) -> Any:
        """`draw(self, *args)`: an algorithm's draw (a function of `rayrep.algos.sampling`,
        sent by reference) run here, where the answers are, so that only what it picks moves.
        It reads `questions`, `names`, `store` and `buckets`, and packs with `usable`, `pack`
        and `numbers`; a draw made over two calls keeps what the second needs in `kept`,
        which every write empties (rows move). Returning (small facts, packed answers), it is
        called with `.options(num_returns=2)` so that the answers can go on by reference."""
        return draw(self, *args)

    KEPT = 16
    """Draws whose state a shard keeps between their two calls (`keep`; one per drawing
    client at a time, more only if a client died between the two calls)."""

    def keep(self, key, value) -> None:
        """Keep `value` for a draw's second call (`kept`), the oldest forgotten beyond `KEPT`."""
        while len(self.kept) >= self.KEPT:
            del self.kept[next(iter(self.kept))]
        self.kept[key] = value

    def stored_answers(self, uids: list[str], limit: DrawLimit | None = None
                       ) -> tuple[tuple[list[tuple[str, list[int]]], int], PackedAnswers]:
        """(((question id, its answers' serial numbers) of those held here with an answer
        `limit` allows, in order; how many answers the limit held back), all those answers
        packed with their prompts). Two values so that a caller can read the small index and
        pass the answers on by reference (`.options(num_returns=2)`)."""
        present = [uid for uid in dict.fromkeys(uids) if uid in self.questions]
        rows, sizes, held_back = self.usable(present, limit)
        kept = sizes > 0
        present = [uid for uid, k in zip(present, kept.tolist()) if k]
        packed = self.pack(present, sizes[kept], rows)
        serials = np.split(self.store.columns["serials"][rows], cumulative_offsets(sizes[kept])[1:-1])
        return ([(uid, own.tolist()) for uid, own in zip(present, serials)], held_back), packed

    def answers_by_serial(self, uids: list[str], serials: list[int]) -> tuple[DrawnFacts, PackedAnswers]:
        """The stored answer of serial number `serials[q]` of each question `uids[q]`, packed;
        a question that no longer holds it (retired, evicted, or a restored shard's new
        numbering) is left out. Their facts, then the answers with their prompts."""
        found_uids, rows = [], []
        for uid, serial in zip(uids, serials):
            entry = self.questions.get(uid)
            if entry is not None:
                match = np.flatnonzero(self.store.columns["serials"][entry.rows] == serial)
                if len(match):
                    found_uids.append(uid)
                    rows.append(entry.rows[match[0]])
        packed = self.pack(found_uids, [1] * len(found_uids), np.array(rows, np.int64))
        return packed.facts_only(), packed

    def excluded_by_bucket(self, exclude: list[str]) -> dict[int, list[str]]:
        """Those of the questions `exclude` held here in a bucket, by bucket."""
        by_bucket: dict[int, list[str]] = {}
        for uid in set(exclude):
            entry = self.questions.get(uid)
            if entry is not None and entry.bucket >= 0:
                by_bucket.setdefault(entry.bucket, []).append(uid)
        return by_bucket

    def bucket_sizes(self, exclude: list[str] = ()) -> dict[int, int]:
        """Questions per bucket (those in `exclude` not counted)."""
        return self.sizes_without(self.excluded_by_bucket(exclude))

    def sizes_without(self, excluded: dict[int, list[str]]) -> dict[int, int]:
        """Questions per bucket, less those `excluded` (`excluded_by_bucket`)."""
        sizes = self.buckets.sizes()
        for k, uids in excluded.items():
            sizes[k] -= len(uids)
        return {k: n for k, n in sizes.items() if n}

    def stats(self, now_step: int | None = None) -> dict:
        """Counts; `bytes`: the live answers' arrays (8 bytes per token, `AnswerStore.ROW_BYTES`
        per answer) plus each question's prompt and row numbers (holes left by evictions not
        counted); `version`: the writes taken."""
        answers = self.store.live_rows
        stats = {
            "questions": len(self.questions),
            "answers": answers,
            "retired": len(self.retired),
            "evicted": self.evicted,
            "bytes": self.store.nbytes + sum(e.prompt_ids.nbytes + e.rows.nbytes for e in self.questions.values()),
            "buckets": self.bucket_sizes(),
            "version": self.version,
        }
        if now_step is not None and answers:
            ages = now_step - self.store.columns["facts"]["step"][self._rows(list(self.questions.values()))]
            stats["age_mean"], stats["age_max"] = float(ages.mean()), int(ages.max())
        return stats

    def prompts_differing(self, prompts: dict[str, np.ndarray]) -> list[str]:
        """Those of the given questions held here under other prompt tokens (another
        tokenizer or chat template wrote them)."""
        return [uid for uid, ids in prompts.items()
                if uid in self.questions and not np.array_equal(self.questions[uid].prompt_ids, ids)]

    def census(self) -> dict[str, dict]:
        """Stored answers by source, by the run that sampled them (unknown: "") and by policy
        version; `version`: {"writes": this shard's version}."""
        facts = self.store.columns["facts"][self._rows(list(self.questions.values()))]

        def count(values) -> dict:
            names, counts = np.unique(values, return_counts=True)
            return dict(zip(names.tolist(), counts.tolist()))

        by_run: dict[str, int] = {}
        for origin, n in count(facts["origin"]).items():
            run = self.store.origins.get(origin, ("", ""))[0]
            by_run[run] = by_run.get(run, 0) + n
        return {
            "by_source": {SOURCES[k]: n for k, n in count(facts["source"]).items()},
            "by_run": by_run,
            "by_version": count(facts["version"]),
            "version": {"writes": self.version},
        }

    def pid(self) -> int:
        """The process holding this shard (whether it still answers: `rayrep.cluster.supervisor.responds`)."""
        return os.getpid()

    # ------------------------------------------------------------------ snapshot

    def export(self) -> dict:
        """Everything, as plain arrays in a stable order (question id, then age), with the
        origins' names, the evictions and the version: what `restore` takes.

        The store is compacted in that order first, so that each question's answers are
        consecutive and go out as views, not copies."""
        if not self.in_id_order:
            self._compact()
        uids = sorted(self.questions)
        return {
            "questions": [(uid, self.store.question_view(self.questions[uid])) for uid in uids],
            "retired": sorted(self.retired),
            "evicted": self.evicted,
            "origins": dict(self.store.origins),
            "version": self.version,
        }

    def restore(self, part: dict) -> None:
        """Hold exactly `part` (an `export`, or a snapshot's share of one): questions, retired,
        evicted, origins and version."""
        # Copied into a new store: arrays that arrive through Ray are read-only views of the
        # call's serialized buffer (all of the restored content), which can then be freed.
        # Question by question into reserved room: one append of everything would first
        # concatenate it all, twice the content in memory at once.
        questions = part["questions"]
        self.kept.clear()
        self.store = AnswerStore()
        self.store.reserve(sum(len(entry.tokens) for _, entry in questions), sum(len(entry) for _, entry in questions))
        self.store.origins = dict(part.get("origins", {}))
        self.questions, self.names = {}, []
        self.buckets = BucketIndex()
        for uid, entry in questions:
            stored = self._new_question(uid, entry.prompt_ids, entry.bucket)
            stored.rows = self.store.append_question(entry, stored.number)
            self.buckets.move(uid, -1, entry.bucket)
        self.retired = set(part["retired"])
        self.evicted = part["evicted"]
        self.version = part.get("version", 0)
        self.in_id_order = [uid for uid, _ in questions] == sorted(uid for uid, _ in questions)


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteReplayShard = ray.remote(ReplayShard)
