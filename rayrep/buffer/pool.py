"""Named replay pools: a replay buffer that outlives runs, shared by several at once.

A pool is S `PoolShard` actors, detached (they outlive the job that started them) and named
`<pool>/shard-<i>` in the `POOL_NAMESPACE` Ray namespace (`rayrep.buffer.replay.pool_shard`
finds them); `jobs/pool.py` starts, stops, inspects, exports and imports pools, and a run
attaches with `--replay.pool NAME` (`AttachedPool(NAME)`) instead of starting
shards of its own. Questions are routed to shards by the same stable hash as a run's
buffer, so a pool and a run's snapshot trade questions freely.

Each shard keeps itself on disk, in `<home>/shard-<i>/`:
- a snapshot (`snapshot-<version>/`, the buffer snapshot format), written on demand
  (`jobs/pool.py snapshot`, `stop`) and whenever the journal outgrows it;
- a journal (`journal-<version>.bin`) of every write since that snapshot, appended before the
  write is answered: a shard that dies (Ray restarts a detached shard, `max_restarts=-1`)
  reads its snapshot and replays the journal, and so comes back with every write it
  answered; a record cut short by the death is dropped and counted (`lost_writes`);
- `shard.json`, which names the current snapshot and journal and is replaced atomically
  once both exist: a crash at any moment leaves a snapshot and journal that belong together.

Writes are idempotent per writer: each carries (writer, sequence number), and a shard that
already applied it answers without applying it again. So a call in flight when its shard
died is simply sent again (`max_task_retries=-1`), and no write is lost or applied twice.
Each shard runs one call at a time, in arrival order: two runs' writes to one shard never
interleave within a call.

The journal holds no pickles: each record is a JSON header and the answers' raw arrays,
with a CRC-32 (the same arrays a snapshot holds).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray

from rayrep.buffer.answers import FACTS, PackedAnswers
from rayrep.buffer.files import BufferFileError, read_pool, read_snapshot, write_pool_export, write_snapshot
from rayrep.buffer.replay import POOL_NAMESPACE, PoolError, ReplayStore, pool_exists, pool_shards
from rayrep.buffer.shard import ReplayShard

DESCRIPTION = "pool.json"
"""The pool's description in its home: name, shards, per-question cap."""


# ---------------------------------------------------------------------- the journal

_ARRAYS = (("counts", np.int64), ("offsets", np.int64), ("tokens", np.int32), ("logprobs", np.float32),
           ("facts", FACTS), ("prompt_offsets", np.int64), ("prompts", np.int32), ("tool_mask", np.bool_))
"""A write's arrays as a journal record holds them, in order (prompts, tool mask: empty when
absent; a record written before the tool mask existed has none)."""
_HEAD = struct.Struct("<II")  # header bytes, body bytes
_TAIL = struct.Struct("<I")   # CRC-32 of header and body


def encode_write(write: dict, items: PackedAnswers | None) -> bytes:
    """One journal record: `write` (JSON values) and the answers' arrays, checksummed."""
    arrays = []
    if items is not None:
        for name, dtype in _ARRAYS:
            value = getattr(items, name)
            arrays.append(np.ascontiguousarray(value if value is not None else np.empty(0, dtype), dtype))
        write = {**write, "uids": items.uids, "origins": [[o, *names] for o, names in items.origins.items()],
                 "lengths": [len(array) for array in arrays]}
    header = json.dumps(write, separators=(",", ":")).encode()
    body = b"".join(array.tobytes() for array in arrays)
    return _HEAD.pack(len(header), len(body)) + header + body + _TAIL.pack(zlib.crc32(header + body))


def decode_writes(data: bytes) -> tuple[list[tuple[dict, PackedAnswers | None]], int]:
    """The whole records of a journal, in order, and the bytes they span (what follows is a
    record cut short: its write never completed)."""
    records, at = [], 0
    while at + _HEAD.size <= len(data):
        header_bytes, body_bytes = _HEAD.unpack_from(data, at)
        end = at + _HEAD.size + header_bytes + body_bytes + _TAIL.size
        if end > len(data):
            break
        header = data[at + _HEAD.size : at + _HEAD.size + header_bytes]
        body = data[at + _HEAD.size + header_bytes : end - _TAIL.size]
        if zlib.crc32(header + body) != _TAIL.unpack_from(data, end - _TAIL.size)[0]:
            break
        write = json.loads(header)
        items = None
        if "uids" in write:
            arrays, offset = {}, 0
            for (name, dtype), count in zip(_ARRAYS, write["lengths"]):
                arrays[name] = np.frombuffer(body, dtype, count, offset).copy()
                offset += count * np.dtype(dtype).itemsize
            items = PackedAnswers(
                uids=write["uids"], counts=arrays["counts"], offsets=arrays["offsets"], tokens=arrays["tokens"],
                logprobs=arrays["logprobs"], facts=arrays["facts"],
                origins={int(o): (run, checkpoint) for o, run, checkpoint in write["origins"]},
                prompt_offsets=arrays["prompt_offsets"] if len(arrays["prompt_offsets"]) else None,
                prompts=arrays["prompts"] if len(arrays["prompt_offsets"]) else None,
                tool_mask=arrays["tool_mask"] if len(arrays.get("tool_mask", ())) else None)
        records.append((write, items))
        at = end
    return records, at


# ---------------------------------------------------------------------- the shard

class PoolShard(ReplayShard):
    """One shard of a named pool: a `ReplayShard` that keeps itself on disk (see the module
    docstring) and takes each write once per (writer, sequence number)."""

    def __init__(self, home: str, index: int, max_answers_per_question: int):
        super().__init__(max_answers_per_question)
        self.folder = Path(home) / f"shard-{index}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.applied: dict[str, int] = {}
        """The last sequence number applied of each writer."""
        self.restarts = 0
        """Times this shard's process died and was started again (counted in its journal)."""
        self.lost_writes = 0
        """Writes cut short by a death (begun in the journal, never answered)."""
        self.journal_bytes = 0
        self._recover()

    # ---------------------------------------------------------------- recovery

    def _pointer(self) -> dict | None:
        path = self.folder / "shard.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as err:
            raise BufferFileError(f"{path}: not valid JSON ({err})") from None

    def _recover(self) -> None:
        """The shard as its last snapshot and journal left it; a shard Ray started again after
        its process died counts the restart in the journal."""
        pointer = self._pointer()
        if pointer is None:
            self._start_journal(0)
            self._commit(None)
            return
        snapshot = self.folder / pointer["snapshot"] if pointer["snapshot"] else None
        if snapshot is not None:
            self.restore(vars(read_snapshot(snapshot)))  # a Snapshot's fields are restore's keys
        self.applied = dict(pointer.get("applied", {}))
        self.restarts, self.lost_writes = pointer.get("restarts", 0), pointer.get("lost_writes", 0)
        self.journal = self.folder / pointer["journal"]
        data = self.journal.read_bytes() if self.journal.is_file() else b""
        records, whole = decode_writes(data)
        for write, items in records:
            self._replay(write, items)
        self.journal_bytes = whole
        if whole < len(data):  # a write the death cut short: it was never answered
            with open(self.journal, "r+b") as journal:
                journal.truncate(whole)
            self._log({"op": "lost", "writes": 1})
            self.lost_writes += 1
        if ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed:
            self._log({"op": "restarted"})
            self.restarts += 1

    def _replay(self, write: dict, items: PackedAnswers | None) -> None:
        if write["op"] == "write":
            self._write(items, write["dedup"], write["buckets"], write["retire"], write.get("evict"))
            self.applied[write["writer"]] = write["seq"]
        elif write["op"] == "restarted":
            self.restarts += 1
        elif write["op"] == "lost":
            self.lost_writes += write["writes"]

    def _log(self, write: dict, items: PackedAnswers | None = None) -> None:
        record = encode_write(write, items)
        with open(self.journal, "ab") as journal:
            journal.write(record)
            journal.flush()  # in the OS's hands before the write is answered: a killed process loses none
        self.journal_bytes += len(record)

    def _start_journal(self, version: int) -> None:
        self.journal = self.folder / f"journal-{version}.bin"
        self.journal.write_bytes(b"")
        self.journal_bytes = 0

    def _commit(self, snapshot: str | None) -> None:
        """Name the current snapshot and journal (atomically replaced)."""
        pointer = {"snapshot": snapshot or "", "journal": self.journal.name, "applied": self.applied,
                   "restarts": self.restarts, "lost_writes": self.lost_writes}
        temp = self.folder / "shard.json.partial"
        temp.write_text(json.dumps(pointer, indent=1))
        os.replace(temp, self.folder / "shard.json")

    # ---------------------------------------------------------------- writes

    def write(self, writer: str, seq: int, items: PackedAnswers | None, dedup: bool, buckets: dict[str, int],
              retire: list[str], evict: tuple[int, int] | None = None) -> dict:
        """A writer's write number `seq` (add, set buckets, retire), applied once: a repeat
        (a call sent again after this shard died) is answered without applying it. Journaled
        before it is answered. Returns stats, with `stored`."""
        return {"stored": self._journaled(writer, seq, items, dedup, buckets, retire, evict), **self.stats()}

    def _take(self, items: PackedAnswers | None, dedup: bool, buckets: dict[str, int], retire: list[str],
              evict: tuple[int, int] | None = None) -> int:
        # A call made as to a run's shard is journaled too, as the next write of a writer "local".
        return self._journaled("local", self.applied.get("local", -1) + 1, items, dedup, buckets, retire, evict)

    def _journaled(self, writer: str, seq: int, items: PackedAnswers | None, dedup: bool, buckets: dict[str, int],
                   retire: list[str], evict: tuple[int, int] | None = None) -> int:
        """`write`'s work: answers stored (0 for a repeat)."""
        if self.applied.get(writer, -1) >= seq:
            return 0
        stored = self._write(items, dedup, buckets, list(retire), evict)
        self.applied[writer] = seq
        self._log({"op": "write", "writer": writer, "seq": seq, "dedup": dedup, "buckets": buckets,
                   "retire": list(retire), "evict": list(evict) if evict is not None else None}, items)
        if self.journal_bytes > max(1 << 20, self.store.nbytes):
            self.snapshot()  # replaying a journal longer than the content would take longer than reading it
        return stored

    # ---------------------------------------------------------------- snapshots

    def snapshot(self) -> int:
        """Write the content as `snapshot-<version>`, start an empty journal, name both in
        `shard.json`, then drop the old ones; returns the version. Until `shard.json` is
        replaced, the old snapshot and journal stand, whole."""
        name = f"snapshot-{self.version}"
        if (self._pointer() or {}).get("snapshot") == name and not self.journal_bytes:
            return self.version  # nothing written since
        write_snapshot([self.export()], self.folder / name)
        self._start_journal(self.version)
        self._commit(name)
        for stale in self.folder.iterdir():
            if stale.name not in (name, self.journal.name, "shard.json"):
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        return self.version

    def stats(self, now_step: int | None = None) -> dict:
        return {**super().stats(now_step), "restarts": self.restarts, "lost_writes": self.lost_writes}

    def describe(self) -> dict:
        """What a client needs to attach: the pool's description (its home's pool.json)."""
        return json.loads((self.folder.parent / DESCRIPTION).read_text())


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemotePoolShard = ray.remote(PoolShard)


# ---------------------------------------------------------------------- starting and stopping

def check_pool_settings(name: str, shards: int, max_answers_per_question: int) -> None:
    """A PoolError unless a pool can be started with this name, shard count and cap."""
    if not name or "/" in name:
        raise PoolError(f"pool name {name!r}: must be non-empty and without '/'")
    if shards < 1:
        raise PoolError(f"pool {name!r}: shards={shards}; a pool needs 1 shard or more")
    if max_answers_per_question < 0:
        raise PoolError(f"pool {name!r}: max_answers_per_question={max_answers_per_question}; 0 keeps every answer, "
                        f"N > 0 the newest N per question")


def start_pool(name: str, home: str | Path, shards: int, max_answers_per_question: int = 0) -> list:
    """Start pool `name`'s shards, detached, keeping themselves in `home`: empty, or as `home`
    holds it (a pool stopped or lost before: then its description decides the shard count,
    and cap, and a different `shards` is refused). Returns the shards, each ready."""
    check_pool_settings(name, shards, max_answers_per_question)
    if pool_exists(name):
        raise PoolError(f"a pool named {name!r} is already running (jobs/pool.py stop --name {name})")
    home = Path(home).resolve()
    described = home / DESCRIPTION
    description = {"name": name, "shards": shards, "max_answers_per_question": max_answers_per_question}
    if described.is_file():
        try:
            kept = json.loads(described.read_text())
        except ValueError as err:
            raise PoolError(f"{described}: not valid JSON ({err})") from None
        if kept.get("name") != name and pool_exists(str(kept.get("name"))):
            # Two pools' shards would append to the same journals and replace each other's pointers.
            raise PoolError(f"{home} is the folder of pool {kept.get('name')!r}, which is running: one folder "
                            f"keeps one pool")
        if kept.get("shards") != shards:
            raise PoolError(f"{described}: the pool in {home} has {kept.get('shards')} shards, not {shards} "
                            f"(questions are routed by the shard count)")
        description = {**kept, "name": name}
    home.mkdir(parents=True, exist_ok=True)
    partial = home / (DESCRIPTION + ".partial")
    partial.write_text(json.dumps(description, indent=1))
    os.replace(partial, described)
    started = [
        RemotePoolShard.options(name=f"{name}/shard-{i}", namespace=POOL_NAMESPACE, lifetime="detached", num_cpus=0,
                                max_restarts=-1, max_task_retries=-1)
        .remote(str(home), i, description["max_answers_per_question"])
        for i in range(shards)
    ]
    ray.get([shard.pid.remote() for shard in started])  # each restored from its home, or fresh
    return started


def snapshot_pool(name: str) -> int:
    """Snapshot every shard of pool `name` now; returns the pool's version (its writes, all shards)."""
    shards, _ = pool_shards(name)
    return sum(ray.get([shard.snapshot.remote() for shard in shards]))


def stop_pool(name: str) -> int:
    """Snapshot every shard of pool `name`, then stop them (their home keeps the pool: `start`
    it again from there). Returns the pool's version."""
    version = snapshot_pool(name)
    for shard in pool_shards(name)[0]:
        ray.kill(shard, no_restart=True)
    return version


# ---------------------------------------------------------------------- export and import

def export_pool(buffer: ReplayStore, path: str | Path) -> dict:
    """Every stored answer of the buffer (a pool's, or any other) as one Parquet experience
    pool: the snapshot's columns, with provenance, which RLEP replays
    (`--algorithm.rlep.pool`) and `import_into` takes back. Returns its counts."""
    parts = buffer.exports()
    written = write_pool_export(parts, Path(path))
    questions = sum(len(part["questions"]) for part in parts)
    answers = sum(len(entry) for part in parts for _, entry in part["questions"])
    return {"path": str(written), "questions": questions, "answers": answers,
            "version": sum(part["version"] for part in parts)}


@dataclass(frozen=True)
class Imported:
    """What a source holds for a buffer (`read_source`), read whole before anything is written."""

    source: str
    items: list
    """(question id, prompt ids, answers)."""
    buckets: dict[str, int]
    retire: list[str]


def read_source(source: str | Path) -> Imported:
    """What `source` holds: a Parquet experience pool (`jobs/collect.py`, an export), a buffer
    snapshot folder, or a run folder (its last snapshot, `<run>/replay`), with a snapshot's
    buckets and retired questions. A BufferFileError names what is wrong with it."""
    source = Path(source)
    if source.is_dir():
        folder = source / "replay" if (source / "replay" / "answers.parquet").is_file() else source
        if not (folder / "answers.parquet").is_file():
            raise BufferFileError(f"{source}: neither a buffer snapshot (answers.parquet) nor a run folder "
                                  f"with one (replay/answers.parquet)")
        snapshot = read_snapshot(folder)
        items = [(uid, entry.prompt_ids, entry.packed(uid, snapshot.origins).unpack()[uid])
                 for uid, entry in snapshot.questions]
        buckets = {uid: entry.bucket for uid, entry in snapshot.questions if entry.bucket >= 0}
        return Imported(str(source), items, buckets, list(snapshot.retired))
    if not source.is_file():
        raise BufferFileError(f"{source}: no such file or folder to import")
    pool = read_pool(source)
    # Runs draw a pool's answers with their recorded behaviour log-probs (RLEP's 'recorded',
    # ExGRPO's shaped loss): every answer must have them.
    lacking = next((uid for uid, (_, answers) in pool.items() if not all(a.arrays().logprobs_known for a in answers)), None)
    if lacking is not None:
        raise BufferFileError(f"{source}: question {lacking!r} has answers without behaviour log-probs (a text pool "
                              f"converted by jobs/collect.py --import-text); import the text with `import --text`, "
                              f"which scores it with the policy")
    return Imported(str(source), [(uid, prompt_ids, answers) for uid, (prompt_ids, answers) in pool.items()], {}, [])


def import_into(buffer: ReplayStore, source: str | Path | Imported) -> dict:
    """Add what `source` holds (`read_source`'s, or a path it reads first) to the buffer,
    deduplicated by token ids; a snapshot's buckets and retired questions come along. Text
    pools need the policy to tokenize and score them: `rayrep.pipelines.text_import.import_text`."""
    read = source if isinstance(source, Imported) else read_source(source)
    stored = add_in_parts(buffer, read.items)
    stats = buffer.apply(buckets=read.buckets, retire=read.retire) if read.buckets or read.retire else buffer.stats()
    return {"source": read.source, "questions": len(read.items), "answers": sum(len(a) for _, _, a in read.items),
            "stored": stored, "retired": len(read.retire), "pool_questions": stats["questions"],
            "pool_answers": stats["answers"]}


IMPORT_QUESTIONS = 2048
"""Questions sent to the shards per call while importing: a call's arguments stay a few MB."""


def add_in_parts(buffer: ReplayStore, items: list) -> int:
    """Add (question id, prompt ids, answers) items, deduplicated, `IMPORT_QUESTIONS` at a
    time; returns how many answers were stored."""
    return sum(buffer.apply(items[first : first + IMPORT_QUESTIONS], dedup=True)["stored"]
               for first in range(0, len(items), IMPORT_QUESTIONS))
