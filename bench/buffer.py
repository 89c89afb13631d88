"""Replay buffer: add throughput, sampling latency and memory held, by size and shard count.

    python bench/buffer.py [--sizes 10000 100000 1000000] [--shards 0 1 2 4]
                           [--answers-per-question 16] [--tokens 256] [--repeats 30] [--snapshot] [--pool]

For each shard count (0 = one in-process shard, else real Ray shard actors on a local
cluster) and each size (stored trajectories of `--tokens` tokens, `--answers-per-question`
per question), it fills a fresh buffer and measures the rows below. With `--pool`, each
shard count above 0 is measured again as a named pool (`rayrep.buffer.pool`: detached
shards, attached to, every write journaled to disk before it is answered), beside the
run's own shards in the same run of the script:

- add: answers/s of `ReplayBuffer.add` in calls of 256 questions (dedup off, as when RLEP
  loads its pool; the test data are made beforehand and not timed);
- RLEP: latency of `sample_answers` for 512 questions x M = 2 (the issue's target: under
  10 ms at 1M trajectories), as RLEP draws by default: token ids without the behaviour
  log-probs, which its learner recomputes (`algorithm.rlep.old_logprobs = recompute`);
- RLEP +log-probs: the same draw with them (`old_logprobs = recorded`, or importance-
  corrected replay), timed alternately with the one before, call by call;
- ExGRPO: latency of `sample_questions(64)` with K = 8 (one call per shard), questions
  spread over buckets 1..7;
- answers 1024: answer-level replay's draw (`race_answers`) of 1,024 answers by priority
  |A| x exp(-age / 4) over every stored answer (two calls per shard: the race's first
  arrival times, then the drawn answers packed), the answers left in
  the shards' results as a training step leaves them, timed alternately with RLEP's;
- call floor: latency of a call to every shard actor that does nothing (`pid`), measured
  beside the draws: what any draw across actors costs here before any work;
- memory: `stats()["bytes"]`, and the growth of the memory of the process(es) holding the
  shards (this process for 0 shards, the shard actors otherwise): resident (RSS) and
  unique (USS: RSS without shared pages, such as Ray's object store mapped into an actor),
  each also over the raw bytes of token ids and log-probs (4 + 4 bytes per token).

With `--snapshot`, also the seconds to snapshot the buffer to Parquet files (in a
temporary directory) and to restore them into a new buffer of the same shard count, and
the files' size over the raw bytes.

Latencies are the median and 90th percentile over `--repeats` calls after one warm-up.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import ray

from rayrep.algos.sampling.exgrpo import sample_questions
from rayrep.algos.sampling.prioritized import race_answers
from rayrep.algos.sampling.rlep import draw_answers
from rayrep.types import Answer
from rayrep.buffer.pool import start_pool, stop_pool
from rayrep.buffer.replay import AttachedPool, ReplayBuffer

K = 8
QUESTIONS_PER_ADD = 256


def memory() -> tuple[int, int]:
    """(RSS, USS) of this process, after handing freed heap memory back to the system (so
    that memory freed by an earlier measurement does not hide the growth of this one)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    info = psutil.Process().memory_full_info()
    return info.rss, info.uss


def _actor_memory(shard) -> tuple[int, int]:
    return memory()


def held_memory(buffer: ReplayBuffer) -> np.ndarray:
    """(RSS, USS) of whatever holds the shards, summed over processes."""
    if buffer.in_process:
        return np.array(memory())
    return np.sum(ray.get([shard.__ray_call__.remote(_actor_memory) for shard in buffer.shards]), axis=0)


def make_batch(first_question: int, questions: int, answers: int, tokens: int, rng) -> list:
    ids = rng.integers(0, 32_000, (questions * answers, tokens), dtype=np.int32)
    logprobs = -rng.random((questions * answers, tokens), dtype=np.float32)
    advantages = rng.normal(size=questions * answers).tolist()  # answer-level replay's priorities
    items = []
    for q in range(questions):
        uid = f"question-{first_question + q}"
        rows = range(q * answers, (q + 1) * answers)
        items.append((uid, np.arange(128, dtype=np.int32),
                      [Answer.of_arrays(ids[r], logprobs[r], 1.0, r % 8, "pool", first_question + q, advantage=advantages[r])
                       for r in rows]))
    return items


def percentiles(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return statistics.median(ordered) * 1e3, ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e3


def timed(call, repeats: int) -> tuple[float, float]:
    return timed_alternately([call], repeats)[0]


def timed_alternately(calls: list, repeats: int) -> list[tuple[float, float]]:
    """Each call's percentiles, the calls taking turns (side by side on a noisy machine)."""
    for call in calls:
        call()
    seconds: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, times in zip(calls, seconds):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return [percentiles(times) for times in seconds]


def run(shards: int, size: int, answers: int, tokens: int, repeats: int, snapshot: bool, seed: int = 0,
        pool: bool = False) -> dict:
    questions = size // answers
    rng = np.random.default_rng(seed)
    gc.collect()
    if pool:
        home = Path(tempfile.mkdtemp(prefix="bench-pool-"))
        name = f"bench-{shards}-{size}"
        start_pool(name, home, shards, answers)
        buffer = AttachedPool(name, writer="bench", seed=seed)
    else:
        buffer = ReplayBuffer(shards, answers, seed=seed)
    buffer.stats()  # actors up before the first measurement
    memory_before = held_memory(buffer)
    add_seconds = 0.0
    for first in range(0, questions, QUESTIONS_PER_ADD):
        items = make_batch(first, min(QUESTIONS_PER_ADD, questions - first), answers, tokens, rng)
        start = time.perf_counter()
        buffer.add(items)
        add_seconds += time.perf_counter() - start
        del items
    gc.collect()
    uids = [f"question-{q}" for q in range(questions)]
    buffer.apply(buckets={uid: 1 + q % (K - 1) for q, uid in enumerate(uids)})
    stats = buffer.stats()
    assert stats["answers"] == questions * answers, stats
    rss_grown, uss_grown = held_memory(buffer) - memory_before

    pick = random.Random(seed)
    # Each call's 512 questions drawn beforehand (the draw is timed, not the bench's choice),
    # the same ones for both kinds of draw.
    questions_per_call = [[(uid, 2) for uid in pick.sample(uids, min(512, len(uids)))] for _ in range(repeats + 1)]

    def rlep_draw(logprobs: bool):
        requests = iter(questions_per_call)
        return lambda: draw_answers(buffer, next(requests), logprobs=logprobs)

    # Answer-level replay's draw of as many answers, by priority over every stored answer
    # (versions 0-7, drawn at version 8, tau 4), left in the shards' results as training does.
    def prioritized_draw():
        return race_answers(buffer, 1024, 8, 4.0, -1)

    rlep, rlep_logprobs, prioritized = timed_alternately([rlep_draw(False), rlep_draw(True), prioritized_draw], repeats)
    exgrpo = timed(lambda: sample_questions(buffer, 64, K, "code"), repeats)
    floor = timed(lambda: ray.get([shard.pid.remote() for shard in buffer.shards]), repeats) if shards else (0.0, 0.0)
    files = None
    if pool:
        start = time.perf_counter()
        stop_pool(name)
        written = time.perf_counter() - start
        file_bytes = sum(f.stat().st_size for f in home.rglob("*") if f.is_file())
        start = time.perf_counter()
        start_pool(name, home, shards)
        restored = time.perf_counter() - start
        assert AttachedPool(name).stats()["answers"] == questions * answers
        files = (written, restored, file_bytes)
        stop_pool(name)
        shutil.rmtree(home)
    elif snapshot:
        directory = Path(tempfile.mkdtemp(prefix="bench-buffer-"))
        try:
            start = time.perf_counter()
            buffer.snapshot(directory)
            written = time.perf_counter() - start
            file_bytes = sum(f.stat().st_size for f in directory.iterdir())
            if shards:
                buffer.shutdown()
            del buffer
            gc.collect()
            buffer = ReplayBuffer(shards, answers, seed=seed)
            buffer.stats()
            start = time.perf_counter()
            buffer.restore(directory)
            restored = time.perf_counter() - start
            assert buffer.stats()["answers"] == questions * answers
            files = (written, restored, file_bytes)
        finally:
            shutil.rmtree(directory)
    if shards and not pool:
        buffer.shutdown()
    del buffer
    gc.collect()
    raw = questions * answers * tokens * 8
    return {
        "shards": shards, "pool": pool, "stored": questions * answers, "add_per_s": questions * answers / add_seconds,
        "add_mb_per_s": raw / add_seconds / 1e6, "rlep": rlep, "rlep_logprobs": rlep_logprobs, "exgrpo": exgrpo,
        "prioritized": prioritized, "floor": floor,
        "held": stats["bytes"], "raw": raw, "rss": rss_grown, "uss": uss_grown, "files": files,
    }


def label(result: dict) -> str:
    return "in-proc" if result["shards"] == 0 else f"{'pool ' if result['pool'] else ''}{result['shards']}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--shards", type=int, nargs="+", default=[0, 1, 2, 4], help="0 = in-process shard")
    parser.add_argument("--answers-per-question", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--snapshot", action="store_true", help="also time snapshot and restore")
    parser.add_argument("--pool", action="store_true", help="also measure each shard count as a named pool")
    args = parser.parse_args(argv)

    if any(args.shards):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = []
    try:
        for size in args.sizes:
            for shards in args.shards:
                for pool in (False, True) if args.pool and shards else (False,):
                    result = run(shards, size, args.answers_per_question, args.tokens, args.repeats, args.snapshot,
                                 pool=pool)
                    results.append(result)
                    print(f"  done: {shards} shards{' (pool)' if pool else ''}, {size:,} trajectories", flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()

    print(f"\nreplay buffer: {args.tokens}-token trajectories, {args.answers_per_question} per question; "
          f"latencies p50 / p90 over {args.repeats} calls; "
          f"raw = token ids + log-probs ({8 * args.tokens} B per trajectory)")
    header = (f"{'shards':>8}{'stored':>11}{'add ans/s':>11}{'add MB/s':>10}{'RLEP 512x2 ms':>16}{'+log-probs ms':>16}{'ExGRPO 64 ms':>15}{'answers 1024 ms':>17}{'floor ms':>10}"
              f"{'held MB':>10}{'held/raw':>10}{'RSS+ MB':>10}{'RSS/raw':>9}{'USS+ MB':>10}{'USS/raw':>9}")
    print(header)
    print("-" * len(header))
    for r in results:
        shards = label(r)
        print(f"{shards:>8}{r['stored']:>11,}{r['add_per_s']:>11,.0f}{r['add_mb_per_s']:>10.0f}"
              f"{r['rlep'][0]:>9.2f} /{r['rlep'][1]:>5.1f}{r['rlep_logprobs'][0]:>9.2f} /{r['rlep_logprobs'][1]:>5.1f}"
              f"{r['exgrpo'][0]:>8.2f} /{r['exgrpo'][1]:>5.1f}{r['prioritized'][0]:>10.2f} /{r['prioritized'][1]:>5.1f}"
              f"{r['floor'][0]:>10.2f}{r['held'] / 1e6:>10.1f}{r['held'] / r['raw']:>10.3f}"
              f"{r['rss'] / 1e6:>10.1f}{r['rss'] / r['raw']:>9.3f}{r['uss'] / 1e6:>10.1f}{r['uss'] / r['raw']:>9.3f}")
    if args.snapshot or args.pool:
        print("\nsnapshot: the run's shards' snapshot to Parquet and restore into new shards (--snapshot); a pool's "
              "stop (snapshot, then stop) and start from its folder (--pool)")
        print(f"\n{'shards':>8}{'stored':>11}{'snapshot s':>12}{'restore s':>11}{'files MB':>10}{'files/raw':>11}")
        for r in results:
            if r["files"] is None:
                continue
            written, restored, file_bytes = r["files"]
            shards = label(r)
            print(f"{shards:>8}{r['stored']:>11,}{written:>12.2f}{restored:>11.2f}"
                  f"{file_bytes / 1e6:>10.0f}{file_bytes / r['raw']:>11.3f}")
    largest = max(r["stored"] for r in results)
    for r in results:
        if r["stored"] == largest:
            verdict = "meets" if r["rlep"][0] < 10 else "misses"
            where = f"{r['shards']} shard(s){' of a pool' if r['pool'] else ''}" if r["shards"] else "in-process shard"
            print(f"RLEP sampling of 512 questions at {largest:,} trajectories, {where}: "
                  f"median {r['rlep'][0]:.2f} ms, {verdict} the 10 ms target "
                  f"({r['rlep_logprobs'][0]:.2f} ms with log-probs)")


if __name__ == "__main__":
    main()
