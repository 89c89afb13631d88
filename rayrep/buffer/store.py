"""A shard's flat columnar store (`AnswerStore`): every answer's token ids, behaviour
log-probs and tool mask in three arenas, one row of small columns per answer, and per question only its
prompt, its bucket and the row numbers of its answers (`StoredQuestion`). Drawing 1,024
answers of 512 questions is then a few vectorized gathers, not a Python step per answer
(which, with an array set per question, took most of a sampling call's time). Python
objects per answer would cost hundreds of bytes each; this way an answer costs its raw
arrays plus 50 bytes.
"""

from __future__ import annotations

import numpy as np

from rayrep.buffer.answers import FACTS, Origins, PackedAnswers, QuestionAnswers, cumulative_offsets, flat_array, spans

class AnswerStore:
    """A shard's answers in flat columns: per token, its id, log-prob and whether a tool
    wrote it, in three arenas (`ARENAS`), and one row per answer (where its tokens start, how
    many, reward, version, source, step).

    Rows and tokens are only appended; an evicted or retired answer leaves a hole, and the
    store is compacted (live rows rewritten in question order) once holes outweigh what
    is live. Every array is the store's own, never a view of a call's arguments (which,
    in a Ray actor, are views of the call's whole serialized buffer)."""

    ARENAS = {"tokens": np.int32, "logprobs": np.float32, "tool_mask": np.bool_}
    """The per-token arrays, by their names in `PackedAnswers` and `QuestionAnswers`."""
    TOKEN_BYTES = sum(np.dtype(dtype).itemsize for dtype in ARENAS.values())
    ROW_COLUMNS = {"starts": np.int64, "lengths": np.int64, "serials": np.int64, "owners": np.int32, "facts": FACTS}
    """Per row: where its tokens start, how many, its serial number (never reused while the
    store lives: how a chosen answer is asked for again even if other writers' answers moved
    it in between, in a shared pool), the number of the question that holds it (-1: a hole;
    what a draw over all answers reads instead of visiting each question), and its facts."""
    ROW_BYTES = 28 + FACTS.itemsize
    GROWTH = 1.5
    """Capacity grows by this factor when full: each byte is copied about three times while
    a shard fills, and unused capacity is address space, not resident memory, until written."""
    COMPACT_ROWS = 65_536
    """Rows copied at a time by `compact`: memory holds the new store plus one such part."""

    def __init__(self):
        self.arenas = {name: np.empty(0, dtype) for name, dtype in self.ARENAS.items()}
        self.columns = {name: np.empty(0, dtype) for name, dtype in self.ROW_COLUMNS.items()}
        self.used_tokens = 0
        self.used_rows = 0
        self.dead_tokens = 0
        self.dead_rows = 0
        self.next_serial = 0
        self.origins: Origins = {}
        """The names of every origin an answer here refers to (`FACTS`' `origin`)."""

    @property
    def live_tokens(self) -> int:
        return self.used_tokens - self.dead_tokens

    @property
    def live_rows(self) -> int:
        return self.used_rows - self.dead_rows

    @property
    def nbytes(self) -> int:
        """Bytes of the live answers: 9 per token (id, log-prob, tool mask), and each row's
        (`ROW_BYTES`)."""
        return self.TOKEN_BYTES * self.live_tokens + self.ROW_BYTES * self.live_rows

    def reserve(self, tokens: int, rows: int) -> None:
        """Room for `tokens` more tokens and `rows` more answers."""
        def grown(array: np.ndarray, used: int, need: int) -> np.ndarray:
            if used + need <= len(array):
                return array
            bigger = np.empty(max(used + need, int(len(array) * self.GROWTH)), array.dtype)
            bigger[:used] = array[:used]
            return bigger

        self.arenas = {name: grown(array, self.used_tokens, tokens) for name, array in self.arenas.items()}
        self.columns = {name: grown(array, self.used_rows, rows) for name, array in self.columns.items()}

    def append(self, batch: PackedAnswers, rows: np.ndarray, owners: np.ndarray) -> np.ndarray:
        """Copy the answers `rows` of a packed batch in, each held by question `owners[i]`;
        returns their row numbers here."""
        lengths = batch.offsets[rows + 1] - batch.offsets[rows]
        offsets = cumulative_offsets(lengths)
        self.reserve(int(offsets[-1]), len(rows))
        span = slice(self.used_tokens, self.used_tokens + int(offsets[-1]))
        consecutive = len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1)
        given = {"tokens": batch.tokens, "logprobs": batch.logprobs, "tool_mask": batch.tool_mask_or_zeros()}
        for name, arena in self.arenas.items():
            if consecutive:  # one slice
                arena[span] = given[name][batch.offsets[rows[0]] : batch.offsets[rows[-1] + 1]]
            else:
                arena[span] = spans(given[name], batch.offsets[rows], lengths)
        new = np.arange(self.used_rows, self.used_rows + len(rows))
        self.origins.update(batch.origins)
        values = {"starts": self.used_tokens + offsets[:-1], "lengths": lengths,
                  "serials": np.arange(self.next_serial, self.next_serial + len(rows)), "owners": owners,
                  "facts": batch.facts[rows]}
        self.next_serial += len(rows)
        for name, array in self.columns.items():
            array[new] = values[name]
        self.used_tokens += int(offsets[-1])
        self.used_rows += len(rows)
        return new

    def append_question(self, entry: QuestionAnswers, owner: int) -> np.ndarray:
        """Copy one question's answers in (a restored snapshot); returns their row numbers."""
        return self.append(entry.packed("", self.origins), np.arange(len(entry)), np.full(len(entry), owner, np.int32))

    def live(self) -> np.ndarray:
        """The row numbers of every answer a question holds, in row order."""
        return np.flatnonzero(self.columns["owners"][: self.used_rows] >= 0)

    def drop(self, rows: np.ndarray) -> None:
        """Rows no question holds any more (evicted, retired): holes until the next compaction."""
        self.columns["owners"][rows] = -1
        self.dead_rows += len(rows)
        self.dead_tokens += int(self.columns["lengths"][rows].sum())

    def tokens_of(self, row: int) -> np.ndarray:
        start = self.columns["starts"][row]
        return self.arenas["tokens"][start : start + self.columns["lengths"][row]]

    def gather(self, uids: list[str], counts, rows: np.ndarray, prompts: list[np.ndarray] | None = None,
               logprobs: bool = True) -> PackedAnswers:
        """The answers `rows`, `counts[q]` of them for question `uids[q]` in turn, packed;
        without their log-probs where `logprobs` is false."""
        starts, lengths = self.columns["starts"][rows], self.columns["lengths"][rows]
        packed = PackedAnswers(
            uids=list(uids), counts=np.asarray(counts, np.int64), offsets=cumulative_offsets(lengths),
            tokens=spans(self.arenas["tokens"], starts, lengths),
            logprobs=spans(self.arenas["logprobs"], starts, lengths) if logprobs else None,
            facts=self.columns["facts"][rows],
        )
        tool_mask = spans(self.arenas["tool_mask"], starts, lengths)
        packed.tool_mask = tool_mask if tool_mask.any() else None
        packed.origins = {int(o): self.origins[int(o)] for o in np.unique(packed.facts["origin"]) if o}
        if prompts is not None:
            packed.prompt_offsets = cumulative_offsets(np.array([len(p) for p in prompts], np.int64))
            packed.prompts = flat_array(prompts, np.int32)
        return packed

    def compact(self, questions: list[StoredQuestion]) -> None:
        """Rewrite the live rows, each question's together in the given order, without holes;
        each question's row numbers change to their new places."""
        sizes = np.array([len(q.rows) for q in questions], np.int64)
        rows = np.concatenate([q.rows for q in questions]) if questions else np.empty(0, np.int64)
        starts, lengths = self.columns["starts"][rows], self.columns["lengths"][rows]
        offsets = cumulative_offsets(lengths)
        arenas = {name: np.empty(offsets[-1], dtype) for name, dtype in self.ARENAS.items()}
        for first in range(0, len(rows), self.COMPACT_ROWS):
            part = slice(first, first + self.COMPACT_ROWS)
            into = slice(offsets[first], offsets[min(first + self.COMPACT_ROWS, len(rows))])
            for name, arena in arenas.items():
                arena[into] = spans(self.arenas[name], starts[part], lengths[part])
        self.arenas = arenas
        self.columns = {name: array[rows] for name, array in self.columns.items()}
        self.columns["starts"] = offsets[:-1].copy()
        self.used_tokens, self.used_rows = int(offsets[-1]), len(rows)
        self.dead_tokens = self.dead_rows = 0
        for question, first in zip(questions, cumulative_offsets(sizes)[:-1].tolist()):
            question.rows = np.arange(first, first + len(question.rows))

    def question_view(self, question: StoredQuestion) -> QuestionAnswers:
        """A question's answers as views of the store (its rows must be consecutive, as after
        `compact`): what a snapshot reads."""
        first, count = (int(question.rows[0]), len(question.rows)) if len(question.rows) else (0, 0)
        rows = slice(first, first + count)
        starts, lengths = self.columns["starts"][rows], self.columns["lengths"][rows]
        entry = QuestionAnswers(question.prompt_ids)
        if count:
            for name, arena in self.arenas.items():
                setattr(entry, name, arena[starts[0] : starts[-1] + lengths[-1]])
            entry.offsets = np.append(starts, starts[-1] + lengths[-1]) - starts[0]
        entry.facts = self.columns["facts"][rows]
        entry.bucket = question.bucket
        return entry


class StoredQuestion:
    """One question in a shard: its prompt, its bucket, and its answers' rows in the store."""

    __slots__ = ("prompt_ids", "rows", "bucket", "number")

    def __init__(self, prompt_ids: np.ndarray, number: int, bucket: int = -1):
        # Always a copy: inside a Ray actor the argument is a read-only view of the whole
        # call's serialized buffer, and keeping the view would pin all of it (every answer
        # of the add call) in the object store for as long as the question lives.
        self.prompt_ids = np.array(prompt_ids, dtype=np.int32)
        self.rows = np.empty(0, np.int64)
        """Row numbers of its answers in the shard's `AnswerStore`, oldest first."""
        self.bucket = bucket
        """Latest count of correct answers out of K (ExGRPO); -1 until set."""
        self.number = number
        """Its number in the shard (`AnswerStore`'s `owners` column names it by this)."""

    def __len__(self) -> int:
        return len(self.rows)
