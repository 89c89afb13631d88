"""RLEP's draw: up to M stored answers of each question, uniformly without replacement."""

from __future__ import annotations

import numpy as np

from rayrep.buffer.answers import DrawLimit, DrawnFacts, PackedAnswers, cumulative_offsets
from rayrep.buffer.replay import ReplayStore
from rayrep.buffer.shard import ReplayShard
from rayrep.types import Answer


def draw_answers(store: ReplayStore, requests: list[tuple[str, int]], limit: DrawLimit | None = None,
                 logprobs: bool = True, by_reference: bool = False) -> dict[str, list[Answer]]:
    """Up to `count` stored answers of each (question id, count) that `limit` allows,
    uniformly without replacement (what a question has when it has fewer: never
    placeholders), one call per shard; those the limit held back are counted
    (`ReplayStore.take_counts`). Without `logprobs` the answers come without their behaviour
    log-probs (NaN) and the draw moves half the bytes. `by_reference`: the answers stay where
    the shards put them, each with its facts and where its arrays are (`Answer.at`), for the
    learners to read (a training step's replays); otherwise they are read here."""
    seed = store.next_seed()
    results = store.draw(on_shard, {
        s: ([uid for uid, _ in group], np.array([count for _, count in group], np.int64), seed + s, limit, logprobs)
        for s, group in store.by_shard(requests).items()
    }, num_returns=2 if by_reference else 1)
    drawn: dict[str, list[Answer]] = {}
    for facts, answers in results.values():
        drawn.update(facts.unpack(at=answers) if by_reference else answers.unpack())
        store.count_held_back(facts.held_back)
    return drawn


def on_shard(shard: ReplayShard, uids: list[str], wanted: np.ndarray, seed: int, limit: DrawLimit | None,
             logprobs: bool) -> tuple[DrawnFacts, PackedAnswers]:
    """A shard's part: up to `wanted[q]` of question `uids[q]`'s answers, packed with their
    prompts; (their facts, the answers), so that the caller can read the facts and pass the
    answers on by reference.

    Ids and counts as a list of strings and an array cross a Ray call about three times
    faster than a list of (id, count) tuples."""
    rng = np.random.default_rng(seed)
    rows, sizes, held_back = shard.usable(uids, limit)
    counts = np.minimum(np.maximum(np.asarray(wanted, np.int64).reshape(-1), 0), sizes)
    # Uniform without replacement, all questions at once: order each question's answers by
    # random keys in [0, 1) (sorting q + key keeps the questions apart, in order) and keep
    # its first counts[q].
    question = np.repeat(np.arange(len(sizes)), sizes)
    order = np.argsort(question + rng.random(len(question)))
    keep = np.arange(len(question)) - cumulative_offsets(sizes)[question] < counts[question]
    packed = shard.pack(uids, counts, rows[order[keep]], logprobs=logprobs)
    packed.held_back = held_back
    return packed.facts_only(), packed
