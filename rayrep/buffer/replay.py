"""ReplayBuffer: the client of S replay shards.

Questions are routed to shards by a stable hash of their id (the same shard on every run
and machine, whatever Python's hash seed). Every operation groups its work by shard and
makes at most one call per shard, all shards in parallel. With zero shards the buffer
keeps one `ReplayShard` in-process (unit tests follow the same code).

Snapshots are Parquet files (schema version in the file metadata): `answers.parquet`
holds one row per stored answer, `questions.parquet` one row per question (bucket,
retired).
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

import numpy as np
import ray

from rayrep.buffer.shard import Answer, PackedAnswers, RemoteReplayShard, ReplayShard

SNAPSHOT_SCHEMA_VERSION = 1


def shard_of(uid: str, num_shards: int) -> int:
    return int.from_bytes(hashlib.blake2b(uid.encode(), digest_size=8).digest(), "big") % num_shards


def bucket_weights(K: int, scale: str) -> dict[int, float]:
    """ExGRPO's bucket weights for k = 1..K-1 correct: a Gaussian N(k/K; 0.5, sigma).

    scale "code": sigma = 1 correct answer (1/K in accuracy units), as the public code
    does; "paper": sigma = 1 in accuracy units, as the paper's text says (nearly uniform).
    """
    if scale not in ("code", "paper"):
        raise ValueError(f"bucket scale must be 'code' or 'paper', got {scale!r}")
    sigma = 1.0 / K if scale == "code" else 1.0
    return {k: math.exp(-((k / K - 0.5) ** 2) / (2 * sigma**2)) for k in range(1, K)}


class ReplayBuffer:
    def __init__(self, num_shards: int, max_answers_per_question: int, seed: int = 0, placement_options: dict | None = None):
        self.num_shards = num_shards
        self.rng = random.Random(seed)
        if num_shards == 0:
            self.local = ReplayShard(max_answers_per_question, seed)
            self.shards = []
        else:
            self.local = None
            # Shards hold memory, not compute: they ask for no CPU of their own.
            options = placement_options or {"num_cpus": 0}
            self.shards = [
                RemoteReplayShard.options(**options).remote(max_answers_per_question, seed * 1000 + i)
                for i in range(num_shards)
            ]

    # ------------------------------------------------------------------ plumbing

    def _call(self, method: str, per_shard_args: dict[int, tuple]) -> dict[int, object]:
        """Call `method` once on each shard that has work, in parallel; results by shard."""
        if self.local is not None:
            return {0: getattr(self.local, method)(*args) for args in per_shard_args.values()}
        refs = {i: getattr(self.shards[i], method).remote(*args) for i, args in per_shard_args.items()}
        return dict(zip(refs, ray.get(list(refs.values()))))

    def _route(self, uid: str) -> int:
        return shard_of(uid, self.num_shards) if self.num_shards else 0

    def _by_shard(self, keyed: list, key=lambda x: x[0]) -> dict[int, list]:
        grouped: dict[int, list] = {}
        for item in keyed:
            grouped.setdefault(self._route(key(item)), []).append(item)
        return grouped

    # ------------------------------------------------------------------ writes

    def add(self, items: list[tuple[str, np.ndarray, list[Answer]]], dedup: bool = False) -> int:
        """Store (question id, prompt ids, answers) items; returns how many answers were stored."""
        packed = {s: (PackedAnswers.pack(group), dedup) for s, group in self._by_shard(items).items()}
        results = self._call("add_packed", packed)
        return sum(results.values())

    def apply(self, items=(), dedup: bool = False, buckets: dict | None = None, retire=()) -> dict:
        """A step's writes in one call per shard: add answers, set buckets, retire questions.

        Returns the merged stats of every shard.
        """
        work: dict[int, dict] = {s: {"items": [], "buckets": {}, "retire": []} for s in range(max(1, self.num_shards))}
        for item in items:
            work[self._route(item[0])]["items"].append(item)
        for uid, k in (buckets or {}).items():
            work[self._route(uid)]["buckets"][uid] = k
        for uid in retire:
            work[self._route(uid)]["retire"].append(uid)
        results = self._call("apply", {
            s: (PackedAnswers.pack(w["items"]), dedup, w["buckets"], w["retire"]) for s, w in work.items()
        })
        return merge_stats(list(results.values()))

    # ------------------------------------------------------------------ reads

    def sample_answers(self, requests: list[tuple[str, int]]) -> dict[str, list[Answer]]:
        """Up to `count` stored answers of each question, uniformly without replacement (RLEP)."""
        seeds = self.rng.getrandbits(63)
        results = self._call("sample_packed", {
            s: ([uid for uid, _ in group], np.array([count for _, count in group], np.int64), seeds + s)
            for s, group in self._by_shard(requests).items()
        })
        merged: dict[str, list[Answer]] = {}
        for part in results.values():
            merged.update(part.unpack())
        return merged

    def all_answers(self, uids: list[str]) -> dict[str, tuple[np.ndarray, list[Answer]]]:
        groups = self._by_shard(uids, key=lambda u: u)
        results = self._call("all_answers_packed", {s: (group,) for s, group in groups.items()})
        merged: dict = {}
        for part in results.values():
            merged.update(part.unpack_with_prompts())
        return merged

    def bucket_sizes(self) -> list[dict[int, int]]:
        """Questions per bucket, shard by shard."""
        results = self._call("bucket_sizes", {s: () for s in range(max(1, self.num_shards))})
        return [results[s] for s in sorted(results)]

    def sample_questions(self, count: int, K: int, scale: str, shard_buckets: list[dict[int, int]] | None = None) -> list[str]:
        """`count` questions (or all there are) drawn by ExGRPO's bucketed scheme.

        Each draw picks a bucket with probability proportional to its weight (among
        buckets with questions left), then a question of that bucket uniformly without
        replacement, whichever shard holds it. The draws are planned here from the shards'
        bucket sizes, then each shard is asked once for its share.
        """
        shard_buckets = shard_buckets if shard_buckets is not None else self.bucket_sizes()
        weights = bucket_weights(K, scale)
        left = {(s, k): n for s, sizes in enumerate(shard_buckets) for k, n in sizes.items() if k in weights and n > 0}
        plan: dict[int, dict[int, int]] = {}
        for _ in range(count):
            totals: dict[int, int] = {}
            for (s, k), n in left.items():
                totals[k] = totals.get(k, 0) + n
            if not totals:
                break
            buckets = sorted(totals)
            k = self.rng.choices(buckets, weights=[weights[b] for b in buckets])[0]
            # Uniform over the bucket's questions across shards: pick a shard by its share.
            shards = sorted(s for (s, b) in left if b == k)
            s = self.rng.choices(shards, weights=[left[(s, k)] for s in shards])[0]
            plan.setdefault(s, {})[k] = plan.get(s, {}).get(k, 0) + 1
            left[(s, k)] -= 1
            if left[(s, k)] == 0:
                del left[(s, k)]
        seeds = self.rng.getrandbits(63)
        results = self._call("sample_questions", {s: (per_bucket, seeds + s) for s, per_bucket in plan.items()})
        return [uid for s in sorted(results) for uid in results[s]]

    def stats(self, now_step: int | None = None) -> dict:
        results = self._call("stats", {s: (now_step,) for s in range(max(1, self.num_shards))})
        return merge_stats(list(results.values()))

    # ------------------------------------------------------------------ snapshot

    def snapshot(self, directory: str | Path) -> Path:
        """Write every shard's content to Parquet files in `directory` (atomically replaced)."""
        from rayrep.buffer.files import write_snapshot

        parts = self._call("export", {s: () for s in range(max(1, self.num_shards))})
        return write_snapshot([parts[s] for s in sorted(parts)], Path(directory))

    def restore(self, directory: str | Path) -> None:
        """Load a snapshot, routing each question to its shard under this buffer's shard count."""
        from rayrep.buffer.files import read_snapshot

        questions, retired, evicted = read_snapshot(Path(directory))
        work: dict[int, tuple[list, list, int]] = {s: ([], [], 0) for s in range(max(1, self.num_shards))}
        for uid, entry in questions:
            work[self._route(uid)][0].append((uid, entry))
        for uid in retired:
            work[self._route(uid)][1].append(uid)
        work[0] = (work[0][0], work[0][1], evicted)
        self._call("restore", work)

    def shutdown(self) -> None:
        for shard in self.shards:
            ray.kill(shard)


def merge_stats(parts: list[dict]) -> dict:
    merged = {"questions": 0, "answers": 0, "retired": 0, "evicted": 0, "bytes": 0, "stored": 0, "buckets": {}}
    ages = []
    for part in parts:
        for key in ("questions", "answers", "retired", "evicted", "bytes", "stored"):
            merged[key] += part.get(key, 0)
        for k, n in part["buckets"].items():
            merged["buckets"][k] = merged["buckets"].get(k, 0) + n
        if "age_mean" in part:
            ages.append((part["age_mean"] * part["answers"], part["answers"], part["age_max"]))
    if ages:
        merged["age_mean"] = sum(a for a, _, _ in ages) / sum(n for _, n, _ in ages)
        merged["age_max"] = max(m for _, _, m in ages)
    return merged
