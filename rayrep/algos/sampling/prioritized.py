"""Answer-level replay's draw: stored answers by priority |A| x exp(-age / decay), without
replacement, across every shard, as an exponential race (Efraimidis and Spirakis): each
answer's time is E / priority with E ~ Exp(1), and the first `count` to arrive are a
weighted draw without replacement. The first `count` over all shards are among each
shard's own first `count`, so two calls per shard move only the answers drawn: each shard
offers the times of its first arrivals (`race_times`), and gives those of them that are
among the first of all (`take_raced`)."""

from __future__ import annotations

import numpy as np

from rayrep.buffer.answers import DrawLimit, DrawnFacts, PackedAnswers
from rayrep.buffer.replay import ReplayStore
from rayrep.buffer.shard import ReplayShard
from rayrep.types import Answer


def priorities(advantages: np.ndarray, ages: np.ndarray, decay: float) -> np.ndarray:
    """The priority of answers: |A| x exp(-age / decay), ages in policy versions (an answer
    from a policy newer than the drawing one counts as age 0); decay 0: |A| alone."""
    value = np.abs(advantages).astype(np.float64)
    if decay > 0:
        value *= np.exp(-np.maximum(ages, 0) / decay)
    return value  # float64: exp(-age / decay) of old answers is far below float32's range


def race_answers(store: ReplayStore, count: int, version: int, decay: float, max_age: int,
                 exclude: frozenset[str] = frozenset(), limit: DrawLimit | None = None) -> list[tuple[str, Answer]]:
    """`count` stored answers (or all there are) drawn by priority at policy version
    `version`, without replacement across every shard; none of the questions `exclude`, none
    sampled more than `max_age` versions ago (-1: any), none `limit` leaves out (counted),
    none without a known, non-zero advantage. (question id, answer) by shard and question,
    each answer left where its shard put it (`Answer.at`), for the learners to read."""
    seed = store.next_seed()
    excluded = store.excluded(exclude)
    args = {s: (count, version, decay, max_age, seed + s, excluded[s], limit) for s in store.every_shard}
    offers = store.draw(race_times, args)
    store.count_held_back(sum(held for _, held in offers.values()))
    times = np.concatenate([offers[s][0] for s in sorted(offers)])
    shards = np.concatenate([np.full(len(offers[s][0]), s) for s in sorted(offers)])
    first = shards[np.argsort(times, kind="stable")[:count]]
    taken = {s: int((first == s).sum()) for s in offers}
    results = store.draw(take_raced, {s: (n, *args[s]) for s, n in taken.items() if n}, num_returns=2)
    return [(uid, answer) for s in sorted(results) for uid, own in results[s][0].unpack(at=results[s][1]).items()
            for answer in own]


def race_times(shard: ReplayShard, count: int, version: int, decay: float, max_age: int, seed: int,
               exclude: list[str], limit: DrawLimit | None) -> tuple[np.ndarray, int]:
    """A shard's offer: the times of its first `count` arrivals (in order) and how many
    answers the limit held back. The shard keeps their rows until `take_raced`. Times are
    drawn in row order, which a restored shard repeats (snapshots are taken and restored in
    question id order): a resumed run draws what the uninterrupted one did."""
    rows, times, held_back = _race(shard, count, version, decay, max_age, seed, exclude, limit)
    shard.keep(("race", seed), rows)
    return times, held_back


def take_raced(shard: ReplayShard, taken: int, count: int, version: int, decay: float, max_age: int, seed: int,
               exclude: list[str], limit: DrawLimit | None) -> tuple[DrawnFacts, PackedAnswers]:
    """The first `taken` answers of the draw `race_times` was asked for with the same
    arguments, packed with their prompts, question by question in question id order (their
    facts, then the answers). A shard written to in between (another run's write to a
    pool), or started again, runs the race again on what it holds now."""
    rows = shard.kept.pop(("race", seed), None)
    if rows is None:
        rows = _race(shard, count, version, decay, max_age, seed, exclude, limit)[0]
    rows = rows[:taken]
    # By question id (question numbers differ in a restored shard), each question's answers
    # in order of arrival.
    numbers, where = np.unique(shard.store.columns["owners"][rows], return_inverse=True)
    uids = [shard.names[n] for n in numbers.tolist()]
    rank = np.argsort(np.argsort(np.array(uids, dtype=object), kind="stable"))
    order = np.argsort(rank[where], kind="stable")
    uids = sorted(uids)
    packed = shard.pack(uids, np.bincount(rank[where], minlength=len(uids)), rows[order])
    return packed.facts_only(), packed


def _race(shard: ReplayShard, count: int, version: int, decay: float, max_age: int, seed: int,
          exclude: list[str], limit: DrawLimit | None) -> tuple[np.ndarray, np.ndarray, int]:
    """(the rows of the first `count` to arrive and their times, in order of arrival; the
    answers the limit held back)."""
    rng = np.random.default_rng(seed)
    rows = shard.store.live()
    facts = shard.store.columns["facts"]  # read field by field: a gather of whole records costs 10x
    advantage, versions = np.abs(facts["advantage"][rows]), facts["version"][rows]
    keep = advantage > 0  # NaN (not known) and 0 (no signal) are never drawn
    if max_age >= 0:
        keep &= versions >= version - max_age
    numbers = shard.numbers(exclude)
    if len(numbers):
        keep &= ~np.isin(shard.store.columns["owners"][rows], numbers)
    held_back = 0
    if limit is not None and limit.limits:
        allowed = limit.allows(facts[rows], shard.store.origins)
        held_back = int((keep & ~allowed).sum())
        keep &= allowed
    # One time per live row, kept or not: the same draw whatever is left out.
    times = rng.standard_exponential(len(rows), dtype=np.float32)
    rows, times = rows[keep], times[keep] / priorities(advantage[keep], version - versions[keep], decay)
    first = np.argpartition(times, count - 1)[:count] if 0 < count < len(times) else np.arange(len(times))[:count]
    first = first[np.argsort(times[first], kind="stable")]
    return rows[first], times[first], held_back
