"""ExGRPO's draw of questions: a bucket by Gaussian weight, then a question of it uniformly.

A question's bucket is its latest number of correct answers k out of K (the algorithm files
it, `ReplayStore.apply(buckets=...)`); the shards keep each bucket's members sorted
(`rayrep.buffer.shard.BucketIndex`), so that a bucket's size and a uniform draw from it cost
no pass over the shard.
"""

from __future__ import annotations

import math

import numpy as np

from rayrep.buffer.replay import ReplayStore
from rayrep.buffer.shard import ReplayShard


def bucket_weights(K: int, scale: str) -> dict[int, float]:
    """ExGRPO's bucket weights for k = 1..K-1 correct: a Gaussian N(k/K; 0.5, sigma).

    scale "code": sigma = 1 correct answer (1/K in accuracy units), as the public code
    does; "paper": sigma = 1 in accuracy units, as the paper's text says (nearly uniform).
    """
    if scale not in ("code", "paper"):
        raise ValueError(f"bucket scale must be 'code' or 'paper', got {scale!r}")
    sigma = 1.0 / K if scale == "code" else 1.0
    return {k: math.exp(-((k / K - 0.5) ** 2) / (2 * sigma**2)) for k in range(1, K)}


def sample_questions(store: ReplayStore, count: int, K: int, scale: str,
                     exclude: frozenset[str] = frozenset()) -> list[str]:
    """`count` questions (or all there are) drawn by ExGRPO's bucketed scheme, none of them
    in `exclude` (questions already in this step).

    Each draw picks a bucket with probability proportional to its weight (among buckets
    with questions left), then a question of that bucket uniformly without replacement,
    whichever shard holds it. One call per shard: each offers its bucket sizes and up to
    `count` of each bucket's questions in a random order (`offer_questions`); here the draws
    are counted per bucket (`bucket_counts`), each bucket's split over the shards as a
    uniform draw over all its questions splits (multivariate hypergeometric), and each
    shard's part taken from the front of its offer.
    """
    weights = bucket_weights(K, scale)
    excluded = store.excluded(exclude)
    offer_seed, plan_seed = store.next_seed(), store.next_seed()
    offers = store.draw(offer_questions, {s: (count, sorted(weights), offer_seed + s, excluded[s])
                                          for s in store.every_shard})
    sizes = {k: [offers[s][0].get(k, 0) for s in store.every_shard] for k in sorted(weights)}
    rng = np.random.default_rng(plan_seed)
    chosen = []
    for k, n in bucket_counts(rng, count, {k: sum(per_shard) for k, per_shard in sizes.items()}, weights).items():
        split = rng.multivariate_hypergeometric(sizes[k], n) if len(sizes[k]) > 1 else [n]
        for s, taken in zip(store.every_shard, split):
            if taken:
                chosen += offers[s][1][k][:taken]
    return chosen


def offer_questions(shard: ReplayShard, count: int, buckets: list[int], seed: int, exclude: list[str] = ()
                    ) -> tuple[dict[int, int], dict[int, list[str]]]:
    """A shard's part of a draw of up to `count` questions from `buckets`, none in `exclude`:
    (questions per bucket, and up to `count` of each bucket's in a uniformly random order).
    Any first n of a bucket's offer are n of its questions drawn uniformly without
    replacement, so the caller takes them in order as it plans the draw over every shard."""
    rng = np.random.default_rng(seed)
    wanted, excluded = set(buckets), shard.excluded_by_bucket(exclude)
    sizes = {k: n for k, n in shard.sizes_without(excluded).items() if k in wanted}
    return sizes, {k: shard.buckets.sample(rng, k, count, excluded.get(k, [])) for k in sorted(sizes)}


def bucket_counts(rng: np.random.Generator, count: int, available: dict[int, int],
                  weights: dict[int, float]) -> dict[int, int]:
    """How many of `count` draws take a question of each bucket, when every draw picks a
    bucket with probability proportional to its weight among the buckets with questions
    left (`available[k]` at first). Drawn in bulk: the picks stand up to the first that
    finds its bucket empty; the rest are drawn again over the buckets left."""
    counts = {k: 0 for k in sorted(available)}
    open_buckets = [k for k in counts if available[k] > 0]
    left = count
    while left and open_buckets:
        p = np.array([weights[k] for k in open_buckets], np.float64)
        picks = rng.choice(len(open_buckets), size=left, p=p / p.sum())
        room = np.array([available[k] - counts[k] for k in open_buckets])
        over = (np.cumsum(np.eye(len(open_buckets), dtype=np.int64)[picks], axis=0) > room).any(axis=1)
        stand = int(over.argmax()) if over.any() else left
        for index, n in enumerate(np.bincount(picks[:stand], minlength=len(open_buckets)).tolist()):
            counts[open_buckets[index]] += n
        left -= stand
        if stand < len(picks):  # that bucket is empty now
            open_buckets.remove(open_buckets[picks[stand]])
    return {k: n for k, n in counts.items() if n}
