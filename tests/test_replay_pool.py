"""Named replay pools (`rayrep.buffer.pool`, `jobs/pool.py`) on a real local Ray cluster:
detached shard actors that outlive their clients, shared by two writers at once, SIGKILLed
and started again by Ray, stopped and restarted from their snapshot folder, and driven end
to end by `jobs/pool.py` in other processes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray

from conftest import kill_and_wait
from rayrep.algos.sampling.exgrpo import sample_questions
from rayrep.algos.sampling.prioritized import race_answers
from rayrep.algos.sampling.rlep import draw_answers
from rayrep.buffer.answers import DrawLimit, origin_id
from rayrep.buffer.files import BufferFileError, read_pool, write_pool
from rayrep.buffer.pool import read_source, start_pool, stop_pool
from rayrep.buffer.replay import AttachedPool, ReplayBuffer, ReplayStore, pool_exists, pool_shards, shard_of

from rayrep.types import Answer

ROOT = Path(__file__).resolve().parents[1]


def answer(question: int, i: int, version: int = 0, run: str = "") -> Answer:
    return Answer.of_arrays(np.array([question, i, 7], np.int32), np.full(3, -0.25, np.float32), 1.0, version, "online", version,
                  1.0, True, run, "base" if run else "")


def items(questions, count: int, first: int = 0, version: int = 0, run: str = ""):
    return [(f"q{q}", np.array([1, 2, q], np.int32), [answer(q, first + i, version, run) for i in range(count)])
            for q in questions]


def content(buffer: ReplayStore, questions=range(40)) -> dict:
    """Every stored answer (its token ids) by question, the buckets, and the stats."""
    stored = {}
    for _, packed in buffer.stored_answers([f"q{q}" for q in questions]):
        packed = ray.get(packed) if isinstance(packed, ray.ObjectRef) else packed
        stored.update({uid: sorted(tuple(a.response_ids.tolist()) for a in answers)
                       for uid, answers in packed.unpack().items()})
    stats = buffer.stats()
    return {"answers": stored, "buckets": stats["buckets"], "retired": stats["retired"], "version": stats["version"]}


@pytest.fixture
def pool(ray_cluster, tmp_path):
    """A fresh two-shard pool kept in tmp_path/pool; stopped at the end if still running."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    start_pool(name, tmp_path / "pool", 2)
    yield name, tmp_path / "pool"
    if pool_exists(name):
        stop_pool(name)


def test_two_writers_at_once_lose_nothing_and_each_draws_the_others_answers(pool):
    name, _ = pool
    writers = {run: AttachedPool(name, writer=run) for run in ("run-a", "run-b")}
    rounds = 25

    def write(run: str, offset: int):
        for r in range(rounds):  # every question each round: both writers hit both shards at once
            writers[run].apply(items(range(20), 2, first=offset + 2 * r, run=run), dedup=True,
                               buckets={f"q{q}": 1 + (r + q) % 7 for q in range(20)})

    threads = [threading.Thread(target=write, args=(run, 1000 * i)) for i, run in enumerate(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = content(writers["run-a"], range(20))
    assert all(len(answers) == 2 * 2 * rounds for answers in held["answers"].values())  # none lost, none twice
    assert len(held["answers"]) == 20 and held["version"] == 2 * rounds * 2  # each write changed both shards
    # Each run draws the other's answers (and only those, when it asks for others' only).
    for run, other_first in (("run-a", 1000), ("run-b", 0)):
        drawn = draw_answers(writers[run], [(f"q{q}", 200) for q in range(20)],
                                            DrawLimit(0, -1, run=run, others_only=True))
        assert {a.run for answers in drawn.values() for a in answers} == {"run-b" if run == "run-a" else "run-a"}
        assert all(a.response_ids[1] >= other_first for answers in drawn.values() for a in answers)
        assert writers[run].take_counts() == {"replay_held_back": 20 * 2 * rounds}
    census = writers["run-a"].census()
    assert census["by_run"] == {"run-a": 20 * 2 * rounds, "run-b": 20 * 2 * rounds}
    assert census["version"] == {"writes": 2 * rounds * 2}


def test_an_age_limit_draws_only_recent_answers_and_counts_the_old(pool):
    name, _ = pool
    buffer = AttachedPool(name, writer="run")
    for version in range(10):
        buffer.apply(items(range(6), 1, first=version, version=version, run="run"))
    drawn = draw_answers(buffer, [(f"q{q}", 10) for q in range(6)], DrawLimit(version=12, max_lag=4, run="run"))
    assert {a.version for answers in drawn.values() for a in answers} == {8, 9}
    assert buffer.take_counts() == {"replay_held_back": 6 * 8}
    # ExGRPO's read of whole questions: the same limit, the same count.
    parts = buffer.stored_answers([f"q{q}" for q in range(6)], DrawLimit(version=12, max_lag=3, run="run"))
    assert sum(len(serials) for index, _ in parts for _, serials in index) == 6
    assert buffer.take_counts() == {"replay_held_back": 6 * 9}
    assert buffer.take_counts() == {}


def kill(buffer: AttachedPool, shard: int) -> int:
    pid = ray.get(buffer.shards[shard].pid.remote())
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_shard_killed_between_and_during_writes_comes_back_whole_and_is_counted(pool):
    name, _ = pool
    buffer = AttachedPool(name, writer="run")
    undisturbed = ReplayBuffer(0, 0)
    for r in range(5):
        for b in (buffer, undisturbed):
            b.apply(items(range(30), 1, first=r), buckets={f"q{q}": 1 + r for q in range(30)}, retire=[f"q{29 - r}"])
    old_pid = kill(buffer, 0)
    for b in (buffer, undisturbed):  # the next write waits for Ray to start shard 0 again
        b.apply(items(range(30), 1, first=10))
    assert ray.get(buffer.shards[0].pid.remote()) != old_pid
    assert content(buffer) | {"version": 0} == content(undisturbed) | {"version": 0}
    assert buffer.take_counts() == {"replay_shard_lost_writes": 0, "replay_shard_replaced": 1}

    # Killed while a large write is on its way: the write is sent again and taken once.
    big = items(range(30), 400, first=100)
    writing = threading.Thread(target=buffer.apply, args=(big,))
    writing.start()
    kill(buffer, 1)
    writing.join()
    undisturbed.apply(big)
    assert content(buffer) | {"version": 0} == content(undisturbed) | {"version": 0}
    counts = buffer.take_counts()
    assert counts.get("replay_shard_replaced", 0) == 1 and counts.get("replay_shard_lost_writes", 0) in (0, 1)


def test_a_pool_started_again_from_its_folder_is_the_pool_it_was(pool):
    name, home = pool
    buffer = AttachedPool(name, writer="run")
    buffer.apply(items(range(25), 3, run="run"), buckets={f"q{q}": q % 8 for q in range(25)}, retire=["q3", "q4"])
    before = content(buffer)
    assert before["version"] > 0 and before["retired"] == 2
    stop_pool(name)
    assert not pool_exists(name)
    start_pool(name, home, 2)
    again = AttachedPool(name, writer="run")
    assert content(again) == before
    # Lost with its cluster, without a last snapshot: the journal brings back every write.
    again.apply(items(range(25), 1, first=50), buckets={"q0": 5})
    # Answer-level replay's writes: answers with advantages, drawn by priority from the pool;
    # an eviction of this run's answers sampled before version 1 (the first write's) is
    # journaled like any write.
    scored = [(uid, ids, [a._replace(advantage=-0.5) for a in answers])
              for uid, ids, answers in items(range(5, 10), 2, first=70, version=3, run="run")]
    again.apply(scored, evict=(origin_id("run", "base"), 1))
    drawn = race_answers(again, 100, 3, 4.0, 2)
    assert sorted((uid, int(a.response_ids[1])) for uid, a in drawn) == \
        sorted((f"q{q}", 70 + i) for q in range(5, 10) for i in range(2))
    after_writes = content(again)
    assert sum(map(len, after_writes["answers"].values())) == 23 + 10  # the first write's 3 each evicted
    for shard in pool_shards(name)[0]:
        kill_and_wait(shard)  # (a kill lands a moment after the call: its name is taken until then)
    deadline = time.monotonic() + 30
    while pool_exists(name):  # the name is free once Ray has recorded the death
        assert time.monotonic() < deadline, "a killed pool's name is still taken"
        time.sleep(0.1)
    start_pool(name, home, 2)
    assert content(AttachedPool(name, writer="run")) == after_writes
    with pytest.raises(Exception, match="has 2 shards, not 3"):
        stop_pool(name)
        start_pool(name, home, 3)
    start_pool(name, home, 2)


def test_a_question_routes_to_the_same_shard_in_a_pool_and_a_run(pool):
    name, _ = pool
    buffer = AttachedPool(name, writer="run")
    buffer.apply(items(range(12), 1))
    for q in range(12):
        shard = buffer.shards[shard_of(f"q{q}", 2)]
        entries, _ = ray.get(shard.stored_answers.options(num_returns=2).remote([f"q{q}"])[0])
        assert [uid for uid, _ in entries] == [f"q{q}"]


def pool_job(*args: str, address: str, fails: bool = False) -> dict | str:
    """`jobs/pool.py ARGS`'s printed result; with `fails`, its error (it must fail)."""
    done = subprocess.run([sys.executable, str(ROOT / "jobs" / "pool.py"), *args], capture_output=True, text=True,
                          env={**os.environ, "RAY_ADDRESS": address}, timeout=300)
    if fails:
        assert done.returncode != 0, done.stdout[-3000:]
        return done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_jobs_pool_commands_work_end_to_end_in_other_processes(ray_cluster, tmp_path):
    address = ray.get_runtime_context().gcs_address
    rows = [{"uid": f"q{q}", "prompt": [{"role": "user", "content": f"{q}?"}], "ground_truth": str(q),
             "data_source": "t", "prompt_ids": [1, 2, q], "response_ids": [q, i, 7], "logprobs": [-0.5] * 3,
             "text": f"{q}", "reward": 1.0, "version": 0} for q in range(10) for i in range(3)]
    write_pool(rows, tmp_path / "seed.parquet", source_checkpoint="base-ckpt")
    name = f"job-{uuid.uuid4().hex[:8]}"
    # A source that cannot be read fails the start before any shard starts or file is written.
    (tmp_path / "broken.parquet").write_text("not parquet")
    error = pool_job("start", "--name", name, "--snapshot-dir", str(tmp_path / "home"), "--from",
                     str(tmp_path / "broken.parquet"), address=address, fails=True)
    assert "broken.parquet" in error and not pool_exists(name) and not (tmp_path / "home").exists()
    started = pool_job("start", "--name", name, "--snapshot-dir", str(tmp_path / "home"), "--shards", "2",
                       "--from", str(tmp_path / "seed.parquet"), address=address)
    try:
        assert started["imported"]["stored"] == 30
        assert pool_exists(name)  # the command that started it has ended; the shards have not
        stats = pool_job("stats", "--name", name, address=address)
        assert (stats["questions"], stats["answers"], stats["by_source"]) == (10, 30, {"pool": 30})
        assert stats["bytes"] > 0 and stats["by_version"] == {"0": 30}
        exported = pool_job("export", "--name", name, "--out", str(tmp_path / "out.parquet"), address=address)
        assert (exported["questions"], exported["answers"]) == (10, 30)
        back = read_pool(tmp_path / "out.parquet")
        assert sorted(back) == sorted(read_pool(tmp_path / "seed.parquet"))
        assert {a.checkpoint for _, answers in back.values() for a in answers} == {"base-ckpt"}
        # A run's buffer snapshot comes in with its buckets; the same answers again are not stored twice.
        run_buffer = ReplayBuffer(0, 0)
        run_buffer.apply(items(range(5, 15), 2, first=20), buckets={f"q{q}": 3 for q in range(5, 15)})
        run_buffer.snapshot(tmp_path / "run" / "replay")
        # One bad source among good ones: nothing imported.
        error = pool_job("import", "--name", name, str(tmp_path / "run"), str(tmp_path / "broken.parquet"),
                         address=address, fails=True)
        assert "broken.parquet" in error and pool_job("stats", "--name", name, address=address)["answers"] == 30
        imported = pool_job("import", "--name", name, str(tmp_path / "run"), str(tmp_path / "out.parquet"),
                            address=address)["imported"]
        assert [i["stored"] for i in imported] == [20, 0]
        assert pool_job("stats", "--name", name, address=address)["buckets"] == {"3": 10}
        version = pool_job("snapshot", "--name", name, address=address)["version"]
        assert pool_job("stop", "--name", name, address=address)["version"] == version
        assert not pool_exists(name)
        pool_job("start", "--name", name, "--snapshot-dir", str(tmp_path / "home"), "--shards", "2", address=address)
        assert pool_job("stats", "--name", name, address=address)["answers"] == 50
    finally:
        if pool_exists(name):
            stop_pool(name)


def test_exgrpo_rlep_and_prioritized_runs_attached_to_one_pool_trade_their_answers(pool, tiny_cfg, tiny_policy,
                                                                                     tmp_path):
    """An ExGRPO run fills the pool with its successes and replays them; an RLEP run attached
    afterwards replays the ExGRPO run's answers (only others', as it asks) and adds its own;
    an answer-level run then stores its answers with their advantages and replays them (the
    others' successes carry none)."""
    from rayrep.run.log import read_metrics
    from rayrep.train import train

    name, _ = pool
    small = {"run.eval_every": 0, "algorithm.prompts_per_step": 16, "learner.mini_batch_prompts": 8,
             "data.arithmetic_test_size": 32, "logging.out_dir": str(tmp_path), "replay.pool": name,
             "logging.plots": False}
    exgrpo = train(tiny_cfg.replace(**small, **{
        "algorithm.name": "exgrpo", "algorithm.std_normalize": False, "run.steps": 3,
        "algorithm.exgrpo.start_pass_rate": 0.0, "logging.run_name": "exgrpo"}), log=lambda _: None)
    records = [r for r in read_metrics(exgrpo.run_dir / "metrics.jsonl") if r["step"] > 0]
    assert records[1]["buffer_questions"] > 0 and records[2]["replayed_questions"] > 0
    held = AttachedPool(name, writer="check").census()["by_run"]
    assert list(held) == [str(exgrpo.run_dir.resolve())]

    rlep = train(tiny_cfg.replace(**small, **{
        "algorithm.name": "rlep", "run.steps": 2, "algorithm.rlep.grow_pool": True, "replay.others_only": True,
        "logging.run_name": "rlep"}), log=lambda _: None)
    records = [r for r in read_metrics(rlep.run_dir / "metrics.jsonl") if r["step"] > 0]
    # The same seed visits the same questions: step 2 those the ExGRPO run stored at its step 2.
    assert records[0]["replay_share"] == 0 and records[1]["replay_share"] > 0
    assert all("replay_shard_replaced" not in r for r in records)
    held = AttachedPool(name, writer="check").census()["by_run"]
    assert set(held) == {str(exgrpo.run_dir.resolve()), str(rlep.run_dir.resolve())}

    prioritized = train(tiny_cfg.replace(**small, **{
        "algorithm.name": "prioritized", "run.steps": 2, "logging.run_name": "prioritized"}), log=lambda _: None)
    records = [r for r in read_metrics(prioritized.run_dir / "metrics.jsonl") if r["step"] > 0]
    # Step 1 finds only the others' successes, none with an advantage; step 2 its own answers.
    assert records[0].get("prioritized_replayed", 0) == 0 and records[1]["prioritized_replayed"] > 0
    held = AttachedPool(name, writer="check").census()["by_run"]
    assert str(prioritized.run_dir.resolve()) in held and len(held) == 3


def test_another_models_text_traces_are_verified_encoded_and_scored_by_the_policy(pool, tiny_cfg, tiny_policy,
                                                                                  tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from rayrep.pipelines.text_import import import_text

    name, _ = pool
    rows = 6
    pq.write_table(pa.table({
        "data_source": ["math_dapo"] * rows,
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(rows)],
        "reward_model": [{"ground_truth": str(2 * i), "style": "rule",
                          "candidates": [f"{i} + {i} = \\boxed{{{2 * i}}}", f"\\boxed{{{2 * i + 1}}}"]
                          + ([f"{i} + {i} is {i} + {i}, " * 20 + f"\\boxed{{{2 * i}}}"] if i == 0 else [])}
                         for i in range(rows)],
        "extra_info": [{"index": f"t{i}"} for i in range(rows)],
    }), tmp_path / "traces.parquet")
    buffer = AttachedPool(name, writer="import")
    imported = import_text(tiny_cfg, tiny_policy, tmp_path / "traces.parquet", buffer, writer="a stronger model",
                           log=lambda _: None)
    # The long one is right, but cut to the policy's answer length it would not be: left out.
    assert (imported["candidates"], imported["too_long"], imported["verified"], imported["wrong"],
            imported["stored"]) == (13, 1, 6, 6, 6)
    drawn = draw_answers(buffer, [(f"t{i}", 5) for i in range(rows)])
    assert sorted(drawn) == [f"t{i}" for i in range(rows)] and all(len(a) == 1 for a in drawn.values())
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    for uid, (answer,) in drawn.items():
        assert (answer.source, answer.verdict, answer.run, answer.checkpoint) == (
            "external", "correct", "imported:traces.parquet", "a stronger model")
        # The policy's own log-probs, one sequence at a time without padding, equal the batched import's.
        prompt = ray.get(pool_shards(name)[0][shard_of(uid, 2)].stored_answers.options(num_returns=2)
                         .remote([uid])[1]).prompts.tolist()
        ids = torch.tensor([prompt + answer.response_ids.tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1] / tiny_cfg.generator.temperature
        own = torch.log_softmax(logits.float(), -1).gather(1, ids[0, 1:, None])[:, 0][len(prompt) - 1 :]
        np.testing.assert_allclose(answer.logprobs, own.numpy(), rtol=1e-4, atol=1e-5)
    assert AttachedPool(name, writer="check").census()["by_source"] == {"external": 6}


def test_a_pool_holding_a_runs_questions_under_other_prompt_tokens_is_refused(pool):
    from rayrep.buffer.replay import PoolError, check_attachable

    name, _ = pool
    buffer = AttachedPool(name, writer="other-tokenizer")
    buffer.apply(items(range(4), 1))  # prompts [1, 2, q]
    same = {f"q{q}": [1, 2, q] for q in range(4)} | {"new": [5]}
    assert buffer.prompts_differing(same) == []
    check_attachable(name, same)
    with pytest.raises(PoolError, match=f"replay pool '{name}' holds 1 of this run's questions .*first: 'q2'"):
        check_attachable(name, same | {"q2": [1, 3, 2]})


def test_a_pool_is_refused_where_it_cannot_work_and_a_run_without_its_pool_starts_nothing(pool, tiny_cfg, tmp_path):
    """No shards, a negative cap, or the folder of a running pool under another name: refused
    before anything starts. A run attached to a pool that is not running fails before its
    folder is written or an actor starts."""
    from rayrep.buffer.replay import PoolError
    from rayrep.train import train

    name, home = pool
    with pytest.raises(PoolError, match="shards=0; a pool needs 1 shard or more"):
        start_pool("other", tmp_path / "other", 0)
    with pytest.raises(PoolError, match="max_answers_per_question=-1"):
        start_pool("other", tmp_path / "other", 2, -1)
    with pytest.raises(PoolError, match=f"is the folder of pool '{name}', which is running"):
        start_pool("other", home, 2)
    assert not pool_exists("other") and not (tmp_path / "other").exists()
    # A pool file without behaviour log-probs (a converted text pool) is refused, naming it.
    write_pool([{"uid": "q1", "prompt": [], "ground_truth": "1", "data_source": "t", "prompt_ids": [1], "response_ids": [2],
                 "logprobs": [float("nan")], "text": "1", "reward": 1.0}], tmp_path / "text.parquet", "imported:t")
    with pytest.raises(BufferFileError, match="text.parquet: question 'q1' has answers without behaviour log-probs"):
        read_source(tmp_path / "text.parquet")
    with pytest.raises(PoolError, match="no replay pool named 'missing' is running"):
        train(tiny_cfg.replace(**{"algorithm.name": "rlep", "replay.pool": "missing", "logging.out_dir": str(tmp_path),
                                  "logging.run_name": "attached"}), log=lambda _: None)
    assert not (tmp_path / "attached").exists()


def test_two_runs_at_once_on_one_pool_lose_no_answer_and_replay_each_others(pool, tmp_path):
    """Two ExGRPO runs (seeds 0 and 1), each its own job process on the cluster, attached to
    one pool at the same time: every answer either stored is in the pool, and they replay
    answers the other sampled."""
    from rayrep.run.log import read_metrics

    name, _ = pool
    address = ray.get_runtime_context().gcs_address
    jobs = [subprocess.Popen(
        [sys.executable, str(ROOT / "jobs" / "train.py"), "--preset", "tiny-cpu", "--algorithm.name", "exgrpo",
         "--algorithm.std_normalize", "false", "--run.steps", "4", "--run.eval_every", "0",
         "--algorithm.prompts_per_step", "16", "--learner.mini_batch_prompts", "8", "--data.arithmetic_test_size", "32",
         "--algorithm.exgrpo.start_pass_rate", "0", "--replay.pool", name, "--replay.retire_scope", "run",
         "--run.seed", str(seed), "--logging.out_dir", str(tmp_path), "--logging.run_name", f"seed-{seed}",
         "--logging.plots", "false"],
        env={**os.environ, "RAY_ADDRESS": address}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for seed in (0, 1)]
    for job in jobs:
        output, _ = job.communicate(timeout=900)
        assert job.returncode == 0, output[-3000:]
    runs = {seed: read_metrics(tmp_path / f"seed-{seed}" / "metrics.jsonl") for seed in (0, 1)}
    stored = {seed: sum(r.get("buffer_stored", 0) for r in records) for seed, records in runs.items()}
    census = AttachedPool(name, writer="check").census()
    assert census["by_run"] == {str((tmp_path / f"seed-{seed}").resolve()): stored[seed] for seed in (0, 1)}
    assert sum(r.get("exgrpo_replays_from_others", 0) for records in runs.values() for r in records) > 0


WRITER = """
import sys, numpy as np, ray
sys.path.insert(0, {root!r})
from rayrep.types import Answer
from rayrep.buffer.replay import AttachedPool
ray.init(log_to_driver=False)
pool = AttachedPool({name!r}, writer="doomed")
for batch in range(10_000):
    pool.apply([(f"q{{q}}", np.array([1, 2, q], np.int32),
                 [Answer.of_arrays(np.array([q, batch, i] + [5] * 200, np.int32), np.zeros(203, np.float32), 1.0)
                  for i in range(8)]) for q in range(40)])
    print(batch, flush=True)
"""


def test_a_run_killed_mid_write_leaves_every_question_whole(pool):
    """A writer SIGKILLed while its writes stream in: each shard took each write whole or not
    at all, so every question holds all 8 answers of a write or none, the pool takes the next
    writes, and started again from its folder it holds the same."""
    name, home = pool
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT), name=name)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env={**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address})
    for _ in range(3):  # a few writes answered, then killed in the middle of the stream
        assert writer.stdout.readline()
    writer.kill()
    writer.wait()
    buffer = AttachedPool(name, writer="after")

    def per_write() -> dict:
        counts = {}
        for _, packed in buffer.stored_answers([f"q{q}" for q in range(40)]):
            for uid, answers in ray.get(packed).unpack().items():
                for a in answers:
                    counts[uid, int(a.response_ids[1])] = counts.get((uid, int(a.response_ids[1])), 0) + 1
        return counts

    counts = per_write()
    assert counts and set(counts.values()) == {8}
    # Every answered write (3 at least) reached both shards; a later one may have reached one shard only.
    assert {batch for (_, batch) in counts} >= {0, 1, 2}
    buffer.apply(items(range(40), 1, first=900))
    held = content(buffer)
    stop_pool(name)
    start_pool(name, home, 2)
    assert content(AttachedPool(name, writer="after")) == held


def test_exgrpo_retires_a_question_for_every_run_or_only_for_itself_as_configured(pool):
    """`replay.retire_scope`: a question one run finds all right leaves the pool for every
    run (`pool`), or stays in the pool for the others while the run that retired it never
    replays it again (`run`)."""
    from test_algorithms import PROMPT_IDS, base_cfg, prompt, step

    from rayrep.algos.exgrpo import ExGRPO
    from rayrep.data import PromptSampler

    name, _ = pool
    K, uids = 4, ["q0", "q1", "q2", "q3"]
    seed = AttachedPool(name, writer="seed")
    seed.apply([(uid, np.array(PROMPT_IDS, np.int32), [answer(q, i) for i in range(3)]) for q, uid in enumerate(uids)],
               buckets={uid: 2 for uid in uids})

    def attached(run: str, scope: str) -> ExGRPO:
        cfg = base_cfg(**{"algorithm.name": "exgrpo", "algorithm.std_normalize": False, "algorithm.group_size": K,
                          "algorithm.prompts_per_step": 4, "learner.mini_batch_prompts": 4,
                          "algorithm.exgrpo.replay_ratio": 0.5, "algorithm.exgrpo.start_pass_rate": 0.99,
                          "replay.pool": name, "replay.retire_scope": scope})
        prompts = [prompt(uid) for uid in uids]
        return ExGRPO(cfg, prompts, {uid: PROMPT_IDS for uid in uids}, AttachedPool(name, writer=run),
                      learners=None, sampler=PromptSampler(prompts, seed=0, keep_at_least=4))

    def replayed_by(algo: ExGRPO, plans: int = 25) -> set[str]:
        """The questions `algo` draws from the pool over many plans (collecting, as after its switch)."""
        algo.collecting = True
        drawn = set()
        for _ in range(plans):
            drawn |= {p.uid for p, n in algo.plan(algo.sampler, 4).requests if n == K - 1}
        algo.collecting = False
        return drawn

    def drawn_by_others() -> set[str]:
        return {uid for _ in range(25) for uid in sample_questions(seed, 4, K, "code")}

    assert drawn_by_others() == set(uids)
    per_run, for_all = attached("run-a", "run"), attached("run-b", "pool")
    # Run a finds q1 all right (its first step, before its switch: it stores nothing).
    _, _, metrics = step(per_run, 1, lambda uid, n: [True] * n if uid == "q1" else [True] + [False] * (n - 1))
    assert per_run.retired_here == {"q1"} and metrics["buffer_retired"] == 0
    assert "q1" in content(seed, range(4))["answers"]  # still in the pool ...
    assert drawn_by_others() == set(uids)  # ... where the others draw it
    assert replayed_by(per_run) == {"q0", "q2", "q3"}  # never again by the run that retired it
    # Run b finds q2 all right: it leaves the pool, for every run.
    _, _, metrics = step(for_all, 1, lambda uid, n: [True] * n if uid == "q2" else [True] + [False] * (n - 1))
    assert for_all.retired_here == set() and metrics["buffer_retired"] == 1
    assert "q2" not in content(seed, range(4))["answers"]
    assert drawn_by_others() == {"q0", "q1", "q3"}
    assert replayed_by(for_all) == {"q0", "q1", "q3"} and replayed_by(per_run) == {"q0", "q3"}
