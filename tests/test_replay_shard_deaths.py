"""A replay shard that dies is restored from the buffer's last snapshot, on a real local Ray cluster.

The shard's process is SIGKILLed between calls and in the middle of a write. The next call
that reaches it starts a replacement, restores the dead shard's questions from the last
snapshot and asks the replacement again; the writes it lost since that snapshot are counted
(`take_counts`), and nothing else changes: the buffer then holds what an undisturbed
buffer given the same writes up to that snapshot holds.
"""

import os
import signal

import numpy as np
import pytest
import ray

from rayrep.algos.sampling.rlep import draw_answers
from rayrep.types import Answer
from rayrep.buffer.replay import ReplayBuffer, shard_of



def answers_of(question: int, count: int, first: int = 0) -> list[Answer]:
    return [Answer.of_arrays(np.array([1000 * question + first + i, 7, 7], np.int32), np.full(3, -0.5, np.float32), 1.0, 0,
                   "online", 0) for i in range(count)]


def items(questions, count: int, first: int = 0):
    return [(f"q{q}", np.array([1, 2, q], np.int32), answers_of(q, count, first)) for q in questions]


def kill(buffer: ReplayBuffer, shard: int) -> int:
    """SIGKILL a shard's process; its pid."""
    pid = ray.get(buffer.shards[shard].pid.remote())
    os.kill(pid, signal.SIGKILL)
    return pid


def content(buffer: ReplayBuffer) -> dict:
    """Every stored answer's first token by question, each question's bucket, the retired set."""
    stored = {}
    for index, packed in buffer.stored_answers([f"q{q}" for q in range(40)]):
        packed = ray.get(packed) if isinstance(packed, ray.ObjectRef) else packed
        stored.update({uid: [int(a.response_ids[0]) for a in answers] for uid, answers in packed.unpack().items()})
    sizes = buffer.bucket_sizes()
    return {"answers": stored, "buckets": [dict(sorted(s.items())) for s in sizes], "retired": buffer.stats()["retired"]}


@pytest.fixture
def two_shards(ray_cluster):
    buffer = ReplayBuffer(2, 0, seed=3)
    yield buffer
    buffer.shutdown()


def test_a_shard_killed_between_calls_comes_back_from_the_last_snapshot(two_shards, tmp_path):
    buffer = two_shards
    assert buffer.take_counts() == {}
    buffer.apply(items(range(20), 3), buckets={f"q{q}": 1 + q % 7 for q in range(20)})
    buffer.snapshot(tmp_path / "snapshot")
    at_snapshot = content(buffer)
    # After the snapshot: 2 answers for each of 10 questions, 2 more questions retired.
    later = items(range(10), 2, first=100)
    buffer.apply(later, retire=["q18", "q19"])
    lost_on_1 = sum(2 for q in range(10) if shard_of(f"q{q}", 2) == 1)
    updates_on_1 = sum(shard_of(uid, 2) == 1 for uid in ("q18", "q19"))
    assert 0 < lost_on_1 < 20

    dead = kill(buffer, 1)
    stats = buffer.stats()  # the first call to reach the dead shard restores it
    assert ray.get(buffer.shards[1].pid.remote()) != dead
    assert buffer.take_counts() == {"replay_shard_replaced": 1, "replay_shard_lost_answers": lost_on_1,
                                      "replay_shard_lost_question_updates": updates_on_1}
    assert buffer.take_counts() == {}  # counted once
    assert stats["answers"] == 60 + 20 - lost_on_1
    # Shard 1 is as it was at the snapshot; shard 0 kept everything.
    now = content(buffer)
    for uid, tokens in now["answers"].items():
        expected = at_snapshot["answers"].get(uid, [])
        if shard_of(uid, 2) == 0 and int(uid[1:]) < 10:
            expected = expected + [1000 * int(uid[1:]) + 100 + i for i in range(2)]
        assert tokens == expected, uid
    assert now["buckets"][1] == at_snapshot["buckets"][1]
    assert set(now["answers"]) == {f"q{q}" for q in range(20)} - {uid for uid in ("q18", "q19") if shard_of(uid, 2) == 0}


def test_a_shard_killed_before_a_write_takes_the_write_after_its_restore(two_shards, tmp_path):
    """Snapshots after every write: a shard that dies loses nothing, and the write that found
    it dead is made on its replacement."""
    buffer, undisturbed = two_shards, ReplayBuffer(0, 0, seed=3)
    for step in range(3):
        writes = items(range(step * 5, step * 5 + 10), 2, first=10 * step)
        buckets = {f"q{q}": 1 + (q + step) % 7 for q in range(step * 5, step * 5 + 10)}
        for target in (buffer, undisturbed):
            target.apply(writes, dedup=True, buckets=buckets, retire=[f"q{step}"] if step else [])
        buffer.snapshot(tmp_path / "snapshot")
    kill(buffer, 0)
    final = items(range(12, 24), 1, first=50)
    stored = buffer.apply(final, buckets={f"q{q}": 4 for q in range(12, 24)})["stored"]
    undisturbed.apply(final, buckets={f"q{q}": 4 for q in range(12, 24)})
    assert buffer.take_counts() == {"replay_shard_replaced": 1, "replay_shard_lost_answers": 0, "replay_shard_lost_question_updates": 0}
    assert stored == 12
    assert content(buffer)["answers"] == content(undisturbed)["answers"]
    merged = {}
    for sizes in buffer.bucket_sizes():
        for k, n in sizes.items():
            merged[k] = merged.get(k, 0) + n
    assert merged == undisturbed.bucket_sizes()[0]
    assert {k: buffer.stats()[k] for k in ("questions", "answers", "retired")} == \
           {k: undisturbed.stats()[k] for k in ("questions", "answers", "retired")}


def test_a_shard_that_dies_before_any_snapshot_comes_back_empty_and_says_what_it_lost(two_shards):
    buffer = two_shards
    buffer.add(items(range(12), 4))
    on_0 = sum(4 for q in range(12) if shard_of(f"q{q}", 2) == 0)
    kill(buffer, 0)
    assert draw_answers(buffer, [(f"q{q}", 2) for q in range(12)]) is not None
    assert buffer.take_counts() == {"replay_shard_replaced": 1, "replay_shard_lost_answers": on_0, "replay_shard_lost_question_updates": 0}
    assert buffer.stats()["answers"] == 48 - on_0
