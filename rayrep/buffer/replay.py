"""The replay store's client: `ReplayStore`, over S replay shards, in two kinds (the run's own
`ReplayBuffer`, an `AttachedPool`).

Questions are routed to shards by a stable hash of their id (the same shard on every run
and machine, whatever Python's hash seed). Every operation groups its work by shard and
makes at most one call per shard, all shards in parallel, each shard method called by
name. With zero shards the buffer keeps one `ReplayShard` in-process (unit tests follow
the same code). The store knows no algorithm: an algorithm's draw is a function of
`rayrep.algos.sampling` that the store runs on the shards (`draw`). In a run, the shards are placed and started with the other roles
(`rayrep.roles.system.Runtime`) and stopped with them.

Snapshots are Parquet files (schema version in the file metadata): `answers.parquet`
holds one row per stored answer, `questions.parquet` one row per question (bucket,
retired).

A shard that dies (its process killed, its node lost) is started anew in its bundle and
restored from the buffer's last snapshot (its questions only), and the call that found it
dead is asked of it again. What was written to it since that snapshot is lost: the buffer
counts it (`take_counts`: `replay_shard_replaced`, `replay_shard_lost_answers`,
`replay_shard_lost_question_updates`), so a run that snapshots after every step's writes
loses nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray

from rayrep.buffer.answers import DrawLimit, PackedAnswers
from rayrep.buffer.shard import RemoteReplayShard, ReplayShard
from rayrep.cluster.placement import Placement
from rayrep.cluster.supervisor import Supervisor
from rayrep.errors import InputError
from rayrep.types import Answer


def shard_of(uid: str, num_shards: int) -> int:
    return int.from_bytes(hashlib.blake2b(uid.encode(), digest_size=8).digest(), "big") % num_shards


POOL_NAMESPACE = "rayrep-pools"
"""The Ray namespace every named pool's shards are named in (`rayrep.buffer.pool`)."""


class PoolError(InputError):
    """A pool that cannot be started, found or attached to, named with the reason."""


def pool_shard(pool: str, index: int):
    """Shard `index` of the running pool `pool` (ValueError if there is none)."""
    return ray.get_actor(f"{pool}/shard-{index}", namespace=POOL_NAMESPACE)


def pool_exists(name: str) -> bool:
    try:
        pool_shard(name, 0)
    except ValueError:
        return False
    return True


def pool_shards(name: str) -> tuple[list, dict]:
    """The running pool `name`'s shards and its description (`describe`)."""
    try:
        first = pool_shard(name, 0)
    except ValueError:
        raise PoolError(f"no replay pool named {name!r} is running on this Ray cluster "
                        f"(start one with: python jobs/pool.py start --name {name} --snapshot-dir DIR)") from None
    description = ray.get(first.describe.remote())
    return [first] + [pool_shard(name, i) for i in range(1, description["shards"])], description


def check_attachable(name: str, prompt_ids: dict[str, list[int]]) -> None:
    """A run may attach to pool `name` only if it runs on this cluster and holds none of the
    run's questions under other prompt tokens (another tokenizer or chat template wrote them:
    it would replay answers to other prompts). A PoolError names what is wrong."""
    differing = AttachedPool(name, writer="check").prompts_differing(prompt_ids)
    if differing:
        raise PoolError(f"replay pool {name!r} holds {len(differing)} of this run's questions under other prompt "
                        f"tokens than this run's tokenizer and chat template give (first: {differing[0]!r}); "
                        f"attach runs of one tokenizer to one pool")


def join_pool_cluster(pool: str) -> None:
    """A run attached to a named pool joins the cluster the pool lives on before anything
    starts: RAY_ADDRESS's, else the one `ray start` runs on this machine (a local cluster of
    its own would hold no pool). A PoolError if there is none."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True, logging_level=logging.ERROR)
    except ConnectionError as err:
        raise PoolError(f"replay.pool {pool!r}: no Ray cluster to find the pool on ({err}); a pool lives on a "
                        f"running cluster (ray start --head; jobs/pool.py start): run there, or set RAY_ADDRESS") from None


class ReplayStore:
    """What a run reads from and writes to: S shard actors (or, with S = 0, one in-process
    shard), behind one protocol with two implementations. `ReplayBuffer` is the run's own
    shards, placed with its other roles, snapshotted into its folder and restored on resume;
    `AttachedPool` is a named pool's, which outlives the run, keeps itself and is written by
    other runs too. Each says what it keeps (`keeps_snapshots`, `snapshot`, `resume`), whose
    retirements it holds (`retires_for_everyone`), what it needs placed (`shards_to_place`)
    and what it stops (`shutdown`): nothing above `rayrep.buffer` asks which one it has
    (`open_replay_store` picks it, from `replay.pool`)."""

    keeps_snapshots = False
    """Whether the run snapshots the store into its folder and restores it on resume."""

    def __init__(self, shards: list, num_shards: int, max_answers_per_question: int, seed: int,
                 start_shard: Callable[[int], Any] | None = None):
        self.rng = random.Random(seed)
        self.num_shards, self.cap = num_shards, max_answers_per_question
        self._routes: dict[str, int] = {}
        self.supervisor = Supervisor("replay shard", shards, start_shard, ready=self._restore_shard,
                                     on_replaced=self._count_lost)
        self.shards = self.supervisor.workers
        self.counts: Counter = Counter()
        """Shards replaced, writes they lost, and answers draws held back (`DrawLimit`),
        since `take_counts` was last called."""

    @staticmethod
    def shards_to_place(cfg) -> int:
        """Shard bundles the run's placement plan must hold for this kind of store."""
        return 0

    @staticmethod
    def check_before_start(cfg, prompt_ids: dict[str, list[int]]) -> None:
        """What can be wrong with the store a run of `cfg` opens, checked before any actor
        starts and before the run's folder is written."""

    def retires_for_everyone(self, scope: str) -> bool:
        """Whether ExGRPO's retirement of a question (`replay.retire_scope`) takes it out of
        the store itself, or only out of this run's view of it."""
        return True

    @property
    def in_process(self) -> bool:
        return self.num_shards == 0

    # ------------------------------------------------------------------ what each kind keeps

    def snapshot(self, directory: str | Path) -> Path:
        """Every shard's content into Parquet files in `directory` (where `keeps_snapshots`)."""
        raise NotImplementedError

    def resume(self, directory: str | Path) -> None:
        """A resumed run's store as its checkpoint holds it; a store that keeps itself went on
        without the run."""

    def shutdown(self) -> None:
        """A store that outlives the run stays up."""

    def _restore_shard(self, s: int, shard) -> ray.ObjectRef | None:
        return None

    def _count_lost(self, replaced: list[int]) -> None:
        pass

    def _write_shards(self, work: dict[int, tuple]) -> dict[int, dict]:
        return self._call(lambda shard: shard.apply, work)

    def _note_stats(self, s: int, stats: dict) -> None:
        pass

    # ------------------------------------------------------------------ plumbing

    def _call(self, method: Callable[[Any], Any], args: dict[int, tuple], num_returns: int = 1) -> dict[int, object]:
        """`method(shard)` (the shard's method, e.g. `lambda shard: shard.apply`) called on
        each shard of `args` with its arguments, all shards in parallel; their results, by
        shard. `num_returns=2` (`stored_answers`): the first result, and the ref of the second,
        left where it is. A shard that died is replaced and restored, and asked again (the
        supervisor, `rayrep.cluster.supervisor`)."""
        if self.in_process:
            return {s: method(self.shards[s])(*a) for s, a in args.items()}
        results, _, _ = self.supervisor.gather(
            {s: s for s in args},
            lambda s, shard: method(shard).options(num_returns=num_returns).remote(*args[s]),
            lambda s: "call")
        return results

    def _route(self, uid: str) -> int:
        if not self.num_shards:
            return 0
        shard = self._routes.get(uid)
        if shard is None:  # hashed once per question: a step routes hundreds of ids
            shard = self._routes[uid] = shard_of(uid, self.num_shards)
        return shard

    def by_shard(self, keyed: list, key=lambda x: x[0]) -> dict[int, list]:
        grouped: dict[int, list] = {}
        for item in keyed:
            grouped.setdefault(self._route(key(item)), []).append(item)
        return grouped

    @property
    def every_shard(self) -> range:
        return range(len(self.shards))

    # ------------------------------------------------------------------ writes

    def add(self, items: list[tuple[str, np.ndarray, list[Answer]]], dedup: bool = False) -> int:
        """Store (question id, prompt ids, answers) items; returns how many answers were stored."""
        results = self._write({s: (PackedAnswers.pack(group), dedup, {}, [], None)
                               for s, group in self.by_shard(items).items()})
        return sum(result["stored"] for result in results.values())

    def _write(self, work: dict[int, tuple]) -> dict[int, dict]:
        """Each shard's write (packed answers, dedup, buckets, retire) in one call, all shards
        in parallel; their stats, by shard. A pool's shards take it as this client's next
        write (`PoolShard.write`), and say whether they restarted or lost writes since."""
        results = self._write_shards(work)
        for s, (_, _, buckets, retire, _) in work.items():
            self._note_write(s, results[s]["stored"], len(buckets) + len(retire))
        return results

    def _note_write(self, s: int, answers: int, question_updates: int) -> None:
        pass

    def apply(self, items=(), dedup: bool = False, buckets: dict | None = None, retire=(),
              evict: tuple[int, int] | None = None) -> dict:
        """A step's writes in one call per shard: add answers, set buckets, retire questions,
        evict answers of origin `evict[0]` sampled before policy version `evict[1]`.

        Returns the merged stats of every shard.
        """
        work: dict[int, dict] = {s: {"items": [], "buckets": {}, "retire": []} for s in self.every_shard}
        for item in items:
            work[self._route(item[0])]["items"].append(item)
        for uid, k in (buckets or {}).items():
            work[self._route(uid)]["buckets"][uid] = k
        for uid in retire:
            work[self._route(uid)]["retire"].append(uid)
        results = self._write({s: (PackedAnswers.pack(w["items"]), dedup, w["buckets"], w["retire"], evict)
                               for s, w in work.items()})
        return merge_stats(list(results.values()))

    # ------------------------------------------------------------------ reads

    def draw(self, draw: Callable[..., Any], args: dict[int, tuple], num_returns: int = 1) -> dict[int, object]:
        """An algorithm's draw run on the shards, where the answers are: `draw(shard, *args[s])`
        on each shard `s` of `args`, all in parallel (`ReplayShard.draw`); their results, by
        shard. With `num_returns=2` a draw returns (facts, packed answers), and the answers
        stay where the shard put them (a ref; the value itself for an in-process buffer)."""
        return self._call(lambda shard: shard.draw, {s: (draw, *a) for s, a in args.items()}, num_returns)

    def next_seed(self) -> int:
        """A seed for one draw, the next of the store's own sequence (`rng`, which a run's
        checkpoint keeps: a resumed run draws what the uninterrupted one did)."""
        return self.rng.getrandbits(63)

    def count_held_back(self, answers: int) -> None:
        """Answers a draw's limit left out (`DrawLimit`), reported by `take_counts`."""
        if answers:
            self.counts["held_back"] += answers

    def stored_answers(self, uids: list[str], limit: DrawLimit | None = None
                       ) -> list[tuple[list[tuple[str, list[int]]], ray.ObjectRef | PackedAnswers]]:
        """Every stored answer of the questions `uids` that `limit` allows, left where it is.

        Per shard holding any of them: ((question id, its answers' serial numbers) in order,
        the answers packed with their prompts, `PackedAnswers`: a ref to the shard's result,
        or the value itself for an in-process buffer). The refs go on to other actors
        (ExGRPO's entropy pass on the learners) without passing through this process; the
        answers the limit held back are counted (`take_counts`).
        """
        groups = self.by_shard(uids, key=lambda u: u)
        parts = self._call(lambda shard: shard.stored_answers, {s: (group, limit) for s, group in groups.items()},
                           num_returns=2)
        self.count_held_back(sum(held for (_, held), _ in parts.values()))
        return [(index, answers) for (index, _), answers in parts.values() if index]

    def answers_by_serial(self, picks: dict[str, int]) -> dict[str, Answer]:
        """The stored answer of serial number `picks[uid]` (from `stored_answers`) of each
        question that still holds it, left where it is (`Answer.at`)."""
        results = self._call(lambda shard: shard.answers_by_serial, {
            s: ([uid for uid, _ in group], [i for _, i in group]) for s, group in self.by_shard(list(picks.items())).items()
        }, num_returns=2)
        return {uid: answers[0] for facts, ref in results.values() for uid, answers in facts.unpack(at=ref).items()}

    def excluded(self, exclude: frozenset[str]) -> dict[int, list[str]]:
        """The questions `exclude`, split by the shard that holds each (every shard named)."""
        return {s: self.by_shard(sorted(exclude), key=lambda u: u).get(s, []) for s in self.every_shard}

    def bucket_sizes(self, exclude: frozenset[str] = frozenset()) -> list[dict[int, int]]:
        """Questions per bucket, shard by shard (questions in `exclude` not counted)."""
        excluded = self.excluded(exclude)
        results = self._call(lambda shard: shard.bucket_sizes, {s: (excluded[s],) for s in self.every_shard})
        return [results[s] for s in self.every_shard]

    def stats(self, now_step: int | None = None) -> dict:
        results = self._call(lambda shard: shard.stats, {s: (now_step,) for s in self.every_shard})
        for s, result in results.items():
            self._note_stats(s, result)
        return merge_stats(list(results.values()))

    def prompts_differing(self, prompt_ids: dict[str, list[int]]) -> list[str]:
        """The questions of `prompt_ids` that the buffer holds under other prompt tokens."""
        groups = self.by_shard(list(prompt_ids), key=lambda u: u)
        parts = self._call(lambda shard: shard.prompts_differing, {
            s: ({uid: np.asarray(prompt_ids[uid], np.int32) for uid in group},) for s, group in groups.items()})
        return sorted(uid for part in parts.values() for uid in part)

    def census(self) -> dict[str, dict]:
        """Stored answers counted by source, by the run that sampled them and by policy
        version; and the buffer's version (the shards' writes)."""
        parts = self._call(lambda shard: shard.census, {s: () for s in self.every_shard})
        merged: dict[str, Counter] = {}
        for part in parts.values():
            for key, counts in part.items():
                merged.setdefault(key, Counter()).update(counts)
        return {key: dict(sorted(counts.items())) for key, counts in merged.items()}

    def exports(self) -> list[dict]:
        """Every shard's content (`ReplayShard.export`), shard by shard."""
        parts = self._call(lambda shard: shard.export, {s: () for s in self.every_shard})
        return [parts[s] for s in self.every_shard]

    def take_counts(self) -> dict[str, int]:
        """As step metrics (`replay_*`), since the last call: shards replaced and the writes
        they lost (`replay_shard_*`), answers held back by draws' limits (`replay_held_back`);
        empty when none of it happened."""
        taken = {f"replay_{name}": n for name, n in sorted(self.counts.items())}
        self.counts = Counter()
        return taken


class ReplayBuffer(ReplayStore):
    """The run's own shards: started in its placement's "replay" bundles (without a placement
    they ask for no CPU of their own: they hold memory, not compute), snapshotted into its
    folder, restored on resume, stopped with it. A shard that dies comes back in its bundle
    holding its questions as of the restore point; what the dead one was given since is
    counted as lost."""

    keeps_snapshots = True

    def __init__(self, num_shards: int, max_answers_per_question: int, seed: int = 0,
                 placement: Placement | None = None):
        self.placement = placement
        self.restore_point: Path | None = None
        """The last snapshot (`snapshot`): what a shard that dies is restored from; None: empty."""
        self._restore_point_counters: list[tuple[int, int]] = [(0, 0)] * max(1, num_shards)
        self._since_snapshot = [Counter() for _ in range(max(1, num_shards))]
        """Per shard: answers and question updates (buckets, retirements) written since the restore point."""
        self.cap = max_answers_per_question
        shards = [ReplayShard(max_answers_per_question)] if num_shards == 0 else \
            [self._start_shard(i) for i in range(num_shards)]
        super().__init__(shards, num_shards, max_answers_per_question, seed, self._start_shard)

    @staticmethod
    def shards_to_place(cfg) -> int:
        return cfg.replay.num_shards

    def _start_shard(self, index: int) -> ray.actor.ActorHandle:
        options = self.placement.options("replay", index) if self.placement else {"num_cpus": 0}
        return RemoteReplayShard.options(**options).remote(self.cap)

    def _note_write(self, s: int, answers: int, question_updates: int) -> None:
        self._since_snapshot[s]["answers"] += answers
        self._since_snapshot[s]["question_updates"] += question_updates

    # ------------------------------------------------------------------ snapshot

    def resume(self, directory: str | Path) -> None:
        self.restore(directory)

    def snapshot(self, directory: str | Path) -> Path:
        """Write every shard's content to Parquet files in `directory` (each file atomically
        replaced); it becomes the restore point of a shard that dies."""
        from rayrep.buffer.files import write_snapshot

        parts = self.exports()
        written = write_snapshot(parts, Path(directory))
        self.restore_point = written
        self._restore_point_counters = [(part["evicted"], part["version"]) for part in parts]
        self._since_snapshot = [Counter() for _ in self.every_shard]
        return written

    @property
    def changed(self) -> bool:
        """Whether anything was written since the restore point (or there is none)."""
        return self.restore_point is None or any(sum(c.values()) for c in self._since_snapshot)

    def restore(self, directory: str | Path) -> None:
        """Load a snapshot, routing each question to its shard under this buffer's shard count."""
        parts = self._snapshot_parts(Path(directory))
        self._call(lambda shard: shard.restore, {s: (part,) for s, part in parts.items()})
        self.restore_point = Path(directory)
        self._restore_point_counters = [(parts[s]["evicted"], parts[s]["version"]) for s in self.every_shard]
        self._since_snapshot = [Counter() for _ in self.every_shard]

    def _snapshot_parts(self, directory: Path, counters: list[tuple[int, int]] | None = None) -> dict[int, dict]:
        """The snapshot in `directory` as each shard's `restore` argument. Evictions and
        versions: `counters` (each shard's as of the snapshot), or, not known by shard, all
        on shard 0."""
        from rayrep.buffer.files import read_snapshot

        snapshot = read_snapshot(directory)
        work = {s: {"questions": [], "retired": [], "origins": snapshot.origins} for s in self.every_shard}
        for uid, entry in snapshot.questions:
            work[self._route(uid)]["questions"].append((uid, entry))
        for uid in snapshot.retired:
            work[self._route(uid)]["retired"].append(uid)
        for s in self.every_shard:
            evicted, version = counters[s] if counters else (snapshot.evicted * (s == 0), snapshot.version * (s == 0))
            work[s].update(evicted=evicted, version=version)
        return work

    def _restore_shard(self, s: int, shard) -> ray.ObjectRef:
        """A new shard `s` given its questions as of the restore point (none before the first snapshot)."""
        content = {"questions": [], "retired": [], "evicted": 0}
        if self.restore_point is not None:
            content = self._snapshot_parts(self.restore_point, self._restore_point_counters)[s]
        return shard.restore.remote(content)

    def _count_lost(self, replaced: list[int]) -> None:
        for s in replaced:
            lost = self._since_snapshot[s]
            self.counts.update(shard_replaced=1, shard_lost_answers=lost["answers"],
                               shard_lost_question_updates=lost["question_updates"])
            self._since_snapshot[s] = Counter()

    def shutdown(self) -> None:
        if not self.in_process:
            for shard in self.shards:
                ray.kill(shard)


class AttachedPool(ReplayStore):
    """A named pool's shards (`rayrep.buffer.pool`), attached to: the pool outlives this
    client and keeps itself (its shards journal, snapshot and restore themselves, and Ray
    restarts them), other runs write to it too, and nothing of it is placed or stopped by the
    run. Each write is applied once per (writer, sequence number)."""

    def __init__(self, pool: str, writer: str = "", seed: int = 0):
        self.pool = pool
        shards, description = pool_shards(pool)
        self.writer = f"{writer or 'client'}#{uuid.uuid4().hex[:12]}"
        """This client's name in the pool's shards: each write is applied once per (writer, sequence number)."""
        self.writes = 0
        self._seen = [Counter() for _ in shards]
        """Per shard: its restarts and lost writes as its last answer said."""
        for s, stats in enumerate(ray.get([shard.stats.remote() for shard in shards])):
            self._seen[s].update(restarts=stats["restarts"], lost_writes=stats["lost_writes"])
        # A pool's shard is started again by Ray and restores itself: nothing to replace here.
        super().__init__(shards, description["shards"], description["max_answers_per_question"], seed)

    @property
    def in_process(self) -> bool:
        return False

    @staticmethod
    def check_before_start(cfg, prompt_ids: dict[str, list[int]]) -> None:
        """The pool lives on a running cluster: join it, and check that the run may attach."""
        join_pool_cluster(cfg.replay.pool)
        check_attachable(cfg.replay.pool, prompt_ids)

    def retires_for_everyone(self, scope: str) -> bool:
        return scope == "pool"

    def snapshot(self, directory: str | Path) -> Path:
        raise ValueError(f"replay pool {self.pool!r} keeps its own snapshots (jobs/pool.py snapshot)")

    def _write_shards(self, work: dict[int, tuple]) -> dict[int, dict]:
        """A pool's shards take each write as this client's next (`PoolShard.write`), and say
        whether they restarted or lost writes since."""
        self.writes += 1
        results = self._call(lambda shard: shard.write, {s: (self.writer, self.writes, *w) for s, w in work.items()})
        for s, result in results.items():
            self._note_stats(s, result)
        return results

    def _note_stats(self, s: int, stats: dict) -> None:
        """Count a pool shard's restarts and lost writes that its stats show since last seen."""
        new = {name: max(0, stats[key] - self._seen[s][key])
               for key, name in (("restarts", "shard_replaced"), ("lost_writes", "shard_lost_writes"))}
        if any(new.values()):
            self.counts.update(new)
        for key in ("restarts", "lost_writes"):
            self._seen[s][key] = stats[key]


def open_replay_store(cfg, placement: Placement | None = None) -> ReplayStore:
    """The run's replay store: the shards of the named pool `replay.pool`, attached to, or
    the run's own `replay.num_shards` shards, in `placement`'s bundles."""
    replay = cfg.replay
    if replay.pool:
        return AttachedPool(replay.pool, writer=cfg.logging.run_name, seed=cfg.run.seed)
    return ReplayBuffer(replay.num_shards, replay.max_answers_per_question, cfg.run.seed, placement)


def store_kind(cfg) -> type[ReplayStore]:
    """The class of the store `open_replay_store` opens for `cfg` (what it needs placed)."""
    return AttachedPool if cfg.replay.pool else ReplayBuffer


def merge_stats(parts: list[dict]) -> dict:
    merged = {"questions": 0, "answers": 0, "retired": 0, "evicted": 0, "bytes": 0, "stored": 0, "version": 0,
              "buckets": {}}
    ages = []
    for part in parts:
        for key in ("questions", "answers", "retired", "evicted", "bytes", "stored", "version"):
            merged[key] += part.get(key, 0)
        for k, n in part["buckets"].items():
            merged["buckets"][k] = merged["buckets"].get(k, 0) + n
        if "age_mean" in part:
            ages.append((part["age_mean"] * part["answers"], part["answers"], part["age_max"]))
    if ages:
        merged["age_mean"] = sum(a for a, _, _ in ages) / sum(n for _, n, _ in ages)
        merged["age_max"] = max(m for _, _, m in ages)
    return merged
