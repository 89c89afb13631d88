"""The replay buffer: shards, the sharded client, snapshot and experience-pool files.

Real code paths only: an in-process shard (`num_shards=0`) and real Ray shard actors.
Expected values come from formulas written out here (hash routing, bucket weights,
binomial tolerances, array sizes), not from the code under test.
"""

import hashlib
import itertools
import math
import tracemalloc
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from rayrep.buffer.files import (
    BufferFileError,
    import_text_pool,
    read_pool,
    read_snapshot,
    write_pool,
)
from rayrep.buffer.answers import PackedAnswers
from rayrep.algos.sampling.exgrpo import bucket_weights, offer_questions, sample_questions
from rayrep.algos.sampling.prioritized import priorities, race_answers
from rayrep.algos.sampling.rlep import draw_answers
from rayrep.buffer.replay import ReplayBuffer, shard_of
from rayrep.buffer.shard import ReplayShard
from rayrep.data.loaders import PromptFileError
from rayrep.types import Answer, answer_arrays

K = 8
CAP = 8
"""Answers kept per question in the shared buffers below."""
SIGMAS = 5.0
"""Tolerance of every frequency check, in binomial standard deviations (all draws are seeded)."""


def make_answer(tokens, reward=1.0, version=0, source="online", step=0, logprobs=None):
    ids = np.asarray(tokens, np.int32)
    if logprobs is None:
        logprobs = -np.arange(1, len(ids) + 1, dtype=np.float32) / 7  # float32 values with long mantissas
    return Answer.of_arrays(ids, np.asarray(logprobs, np.float32), reward, version, source, step)


def answers_of(question: int, count: int, length: int = 5, step: int = 0):
    """`count` distinct answers of a question; answer i starts with token 1000 * question + i."""
    return [make_answer([1000 * question + i] + [7] * (length - 1), step=step) for i in range(count)]


def prompt(question: int) -> np.ndarray:
    return np.array([1, 2, question], np.int32)


def first_tokens(answers):
    return [int(a.response_ids[0]) for a in answers]


def binomial_tolerance(n: int, p: float) -> float:
    """Allowed deviation of an observed frequency from p over n trials."""
    return SIGMAS * math.sqrt(p * (1 - p) / n) + 1e-12


def assert_same_answer(a: Answer, b: Answer):
    assert a.response_ids.dtype == np.int32 and a.logprobs.dtype == np.float32
    assert np.array_equal(a.response_ids, b.response_ids)
    # Bit patterns, so NaN log-probs compare equal and float32 values exactly.
    assert np.array_equal(a.logprobs.view(np.uint32), np.asarray(b.logprobs, np.float32).view(np.uint32))
    assert (a.reward, a.version, a.source, a.step) == (b.reward, b.version, b.source, b.step)


def stored_of(buffer: ReplayBuffer, uids: list[str]) -> dict[str, tuple[np.ndarray, list[Answer]]]:
    """(prompt ids, every stored answer, oldest first) of each question held, through the
    buffer's own read of whole questions (what ExGRPO's entropy pass receives)."""
    found = {}
    for index, answers in buffer.stored_answers(uids):
        packed = ray.get(answers) if isinstance(answers, ray.ObjectRef) else answers
        assert [uid for uid, _ in index] == packed.uids and [len(serials) for _, serials in index] == packed.counts.tolist()
        for q, (uid, answers) in enumerate(packed.unpack().items()):
            found[uid] = (packed.prompt(q), answers)
    return found


@pytest.fixture(scope="module")
def buffers(ray_cluster, tmp_path_factory):
    """`buffers(shards, seed)`: an empty buffer with CAP answers per question.

    Zero shards: a new in-process buffer. Two or three: one set of Ray shard actors per
    shard count for the whole module (starting an actor takes about a second here), emptied
    before each use by restoring an empty snapshot, which replaces every shard's content.
    """
    empty = ReplayBuffer(0, CAP).snapshot(tmp_path_factory.mktemp("empty-snapshot"))
    remote = {shards: ReplayBuffer(shards, CAP) for shards in (2, 3)}

    def get(shards: int, seed: int = 0) -> ReplayBuffer:
        if shards == 0:
            return ReplayBuffer(0, CAP, seed=seed)
        buffer = remote[shards]
        buffer.restore(empty)
        buffer.rng.seed(seed)
        return buffer

    yield get
    for buffer in remote.values():
        buffer.shutdown()


# ---------------------------------------------------------------------- routing


def test_shard_of_is_blake2b_of_the_uid_modulo_the_shard_count():
    pinned = {("q-0", 3): 1, ("question/17", 3): 2, ("question/17", 7): 5, ("a1b2c3d4", 4): 1, ("üñí", 7): 6}
    for (uid, shards), expected in pinned.items():
        digest = hashlib.blake2b(uid.encode("utf-8"), digest_size=8).digest()
        assert int.from_bytes(digest, "big") % shards == expected
        assert shard_of(uid, shards) == expected
    for i in range(200):
        uid = f"uid-{i}"
        digest = int.from_bytes(hashlib.blake2b(uid.encode(), digest_size=8).digest(), "big")
        assert [shard_of(uid, s) for s in (1, 2, 3, 4)] == [digest % s for s in (1, 2, 3, 4)]


def test_four_shards_get_an_even_share_of_uids():
    counts = Counter(shard_of(f"question-{i}", 4) for i in range(4000))
    assert sorted(counts) == [0, 1, 2, 3]
    assert all(800 <= n <= 1200 for n in counts.values()), counts


def test_a_uid_lands_on_the_same_shard_in_every_buffer(buffers):
    uids = [f"route-{i}" for i in range(12)]
    another = ReplayBuffer(2, CAP, seed=5)
    for buffer in (buffers(2), buffers(3), another):
        # Bucket number i marks question i, so the per-shard bucket sizes say where each one is.
        buffer.apply([(uid, prompt(i), answers_of(i, 1)) for i, uid in enumerate(uids)],
                     buckets={uid: 100 + i for i, uid in enumerate(uids)})
        sizes = buffer.bucket_sizes()
        where = {k - 100: s for s, per_shard in enumerate(sizes) for k, n in per_shard.items() for _ in range(n)}
        assert where == {i: shard_of(uid, len(sizes)) for i, uid in enumerate(uids)}
    another.shutdown()


# ---------------------------------------------------------------------- RLEP sampling


def test_sample_answers_draws_distinct_stored_answers_never_placeholders():
    buffer = ReplayBuffer(0, 64, seed=1)
    stored = {"ten": answers_of(1, 10), "two": answers_of(2, 2)}
    buffer.add([("ten", prompt(1), stored["ten"]), ("two", prompt(2), stored["two"])])
    for _ in range(50):
        got = draw_answers(buffer, [("ten", 4), ("two", 5), ("unknown", 2), ("ten-zero", 0)])
        assert len(got["ten"]) == 4 and len(set(first_tokens(got["ten"]))) == 4
        # Fewer than asked: exactly what is stored, no padding.
        assert sorted(first_tokens(got["two"])) == [2000, 2001]
        assert got["unknown"] == [] and got["ten-zero"] == []
        for answer in got["ten"] + got["two"]:
            source = stored["ten" if answer.response_ids[0] < 2000 else "two"][answer.response_ids[0] % 1000]
            assert_same_answer(answer, source)
    assert draw_answers(buffer, [("ten", 0)]) == {"ten": []}


def test_sample_answers_is_uniform_without_replacement():
    n, m, draws = 10, 3, 6000
    buffer = ReplayBuffer(0, 64, seed=2)
    buffer.add([("q", prompt(0), answers_of(0, n))])
    per_answer, per_subset = Counter(), Counter()
    for _ in range(draws):
        picked = first_tokens(draw_answers(buffer, [("q", m)])["q"])
        assert len(set(picked)) == m
        per_answer.update(picked)
        per_subset[tuple(sorted(picked))] += 1
    # Each answer is in a draw with probability m / n.
    for i in range(n):
        assert abs(per_answer[i] / draws - m / n) <= binomial_tolerance(draws, m / n), (i, per_answer[i])
    # Every m-subset equally likely: chi-square over the C(n, m) subsets, against the
    # Wilson-Hilferty approximation of its 1 - 1e-6 quantile.
    subsets = math.comb(n, m)
    assert len(per_subset) == subsets
    expected = draws / subsets
    chi2 = sum((per_subset.get(s, 0) - expected) ** 2 / expected for s in itertools.combinations(range(n), m))
    df = subsets - 1
    z = 4.75  # one-sided normal quantile for 1e-6
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < limit, (chi2, limit)


def test_sample_answers_across_ray_shards(buffers):
    questions, n, m, draws = 30, 6, 2, 150
    buffer = buffers(2, seed=3)
    buffer.add([(f"q{q}", prompt(q), answers_of(q, n)) for q in range(questions)])
    assert {shard_of(f"q{q}", 2) for q in range(questions)} == {0, 1}  # both shards hold questions
    counts = Counter()
    for _ in range(draws):
        got = draw_answers(buffer, [(f"q{q}", m) for q in range(questions)] + [("nowhere", 2)])
        assert got["nowhere"] == []
        for q in range(questions):
            picked = first_tokens(got[f"q{q}"])
            assert len(picked) == m and len(set(picked)) == m
            assert all(t // 1000 == q for t in picked)
            counts.update(picked)
    p = m / n
    z_squared = []
    for q in range(questions):
        for i in range(n):
            frequency = counts[1000 * q + i] / draws
            assert abs(frequency - p) <= binomial_tolerance(draws, p), (q, i, frequency)
            z_squared.append((frequency - p) ** 2 / (p * (1 - p) / draws))
    # Each z^2 has mean 1 (each draw includes an answer with probability p, independently
    # across draws); their sum over all 180 cells stays near 180.
    assert 0.6 * len(z_squared) < sum(z_squared) < 1.5 * len(z_squared), sum(z_squared)
    few = draw_answers(buffer, [("q0", 50)])["q0"]
    assert sorted(first_tokens(few)) == list(range(n))
    for answer in few:
        assert_same_answer(answer, answers_of(0, n)[answer.response_ids[0]])


@pytest.mark.parametrize("shards", [0, 2])
def test_a_draw_without_logprobs_is_the_same_draw_less_its_logprobs(buffers, shards):
    """RLEP's default draw leaves the log-probs on the shards (its learner recomputes them):
    the same answers as a draw with them from the same seed, each with NaN log-probs of its
    length, and every other fact the same."""
    questions, n, m = 12, 6, 3
    stored = {f"q{q}": answers_of(q, n, length=3 + q % 4) for q in range(questions)}
    requests = [(uid, m) for uid in stored]
    drawn = []
    for logprobs in (True, False):
        buffer = buffers(shards, seed=9)
        buffer.add([(uid, prompt(q), stored[uid]) for q, uid in enumerate(stored)])
        drawn.append([draw_answers(buffer, requests, logprobs=logprobs) for _ in range(3)])
    for full, bare in zip(*drawn):
        assert full.keys() == bare.keys() == stored.keys()
        for uid in stored:
            assert first_tokens(bare[uid]) == first_tokens(full[uid]) and len(bare[uid]) == m
            for with_them, without in zip(full[uid], bare[uid]):
                assert_same_answer(with_them, stored[uid][with_them.response_ids[0] % 1000])
                assert np.array_equal(without.response_ids, with_them.response_ids)
                assert without.logprobs.dtype == np.float32 and len(without.logprobs) == len(without.response_ids)
                assert np.isnan(without.logprobs).all()
                assert (without.reward, without.version, without.source, without.step) == (
                    with_them.reward, with_them.version, with_them.source, with_them.step)


# ---------------------------------------------------------------------- caps and dedup


def stored_first_tokens(buffer, uid):
    return first_tokens(stored_of(buffer, [uid])[uid][1])


def test_cap_keeps_the_newest_answers_in_order_and_counts_evictions():
    buffer = ReplayBuffer(0, 3)
    assert buffer.add([("q", prompt(0), answers_of(0, 5))]) == 5
    assert stored_first_tokens(buffer, "q") == [2, 3, 4]
    assert buffer.stats()["evicted"] == 2 and buffer.stats()["answers"] == 3

    one_by_one = ReplayBuffer(0, 3)
    for i, answer in enumerate(answers_of(0, 5)):
        one_by_one.add([("q", prompt(0), [answer])])
        assert stored_first_tokens(one_by_one, "q") == list(range(max(0, i - 2), i + 1))
    assert one_by_one.stats()["evicted"] == 2
    # The kept answers are whole: token ids and log-probs of answers 2, 3, 4.
    for got, source in zip(stored_of(one_by_one, ["q"])["q"][1], answers_of(0, 5)[2:]):
        assert_same_answer(got, source)


def test_evictions_and_retirements_compact_the_store_keeping_every_live_answer():
    """Evicted and retired answers leave holes in the shard's flat store; once the holes
    outweigh the live answers the store is rewritten without them, and what is stored
    reads back exactly as before."""
    buffer = ReplayBuffer(0, 2)
    contents = {}
    for round_ in range(6):
        items = [(f"c{q}", prompt(q), [make_answer([q, round_, i] + [9] * (q + i), step=round_) for i in range(3)])
                 for q in range(5)]
        buffer.add(items)
        for uid, _, answers in items:
            contents[uid] = answers[-2:]  # a cap of 2 keeps the newest two
    buffer.apply(retire=["c1", "c3"])
    del contents["c1"], contents["c3"]
    (shard,) = buffer.shards
    store = shard.store
    # 90 answers were stored, 6 are live: compaction ran (the holes never outweigh what is live).
    assert store.live_rows == 6 and store.dead_rows <= store.live_rows and store.used_rows < 90
    assert store.dead_tokens <= store.live_tokens
    stored = stored_of(buffer, ["c0", "c1", "c2", "c3", "c4"])
    assert stored.keys() == contents.keys()
    for uid, answers in contents.items():
        assert len(stored[uid][1]) == 2
        for got, source in zip(stored[uid][1], answers):
            assert_same_answer(got, source)
    assert buffer.stats()["answers"] == 6 and buffer.stats()["evicted"] == 5 * (18 - 2)


def test_a_cap_of_zero_keeps_every_answer():
    buffer = ReplayBuffer(0, 0)  # what the ExGRPO code does: no cap
    for _ in range(3):
        buffer.add([("q", prompt(0), answers_of(0, 40))])
    assert buffer.stats()["answers"] == 120 and buffer.stats()["evicted"] == 0
    assert stored_first_tokens(buffer, "q") == list(range(40)) * 3


def test_dedup_by_token_ids_also_within_one_add():
    buffer = ReplayBuffer(0, 8)
    a, b, c = make_answer([5, 6, 7]), make_answer([5, 6]), make_answer([5, 6, 8])
    a_again = make_answer([5, 6, 7], reward=0.5, logprobs=[0.0, 0.0, 0.0])  # same tokens, other metadata
    assert buffer.add([("q", prompt(0), [a, a_again, b])], dedup=True) == 2
    assert buffer.add([("q", prompt(0), [b, c, c])], dedup=True) == 1
    got = stored_of(buffer, ["q"])["q"][1]
    assert [g.response_ids.tolist() for g in got] == [[5, 6, 7], [5, 6], [5, 6, 8]]
    assert_same_answer(got[0], a)  # the first copy is the one kept
    assert buffer.add([("q", prompt(0), [a])]) == 1  # without dedup duplicates are stored
    assert buffer.stats()["answers"] == 4


def test_the_buffer_shares_no_arrays_with_its_callers():
    buffer = ReplayBuffer(0, 8)
    prompt_ids = np.array([3, 4, 5], np.int32)
    answer = make_answer([9, 9])
    buffer.add([("q", prompt_ids, [answer])])
    prompt_ids[:] = 0
    answer.response_ids[:] = 0
    stored_prompt, (stored,) = stored_of(buffer, ["q"])["q"]
    assert stored_prompt.tolist() == [3, 4, 5] and stored.response_ids.tolist() == [9, 9]
    # What comes out is the caller's to change, too.
    (sampled,) = draw_answers(buffer, [("q", 1)])["q"]
    for array in (stored_prompt, stored.response_ids, stored.logprobs, sampled.response_ids, sampled.logprobs):
        array[:] = 0
    stored_prompt, (stored,) = stored_of(buffer, ["q", "q"])["q"]
    assert stored_prompt.tolist() == [3, 4, 5]
    assert_same_answer(stored, make_answer([9, 9]))


def test_answers_whose_logprobs_do_not_match_their_tokens_are_refused(buffers):
    good, bad = make_answer([1, 2, 3]), make_answer([1, 2, 3], logprobs=[-0.5, -0.5])
    for shards in (0, 2):
        buffer = buffers(shards)
        with pytest.raises(ValueError, match=r"question 'b', answer 1: 3 token ids but 2 log-probs"):
            buffer.add([("a", prompt(0), [good]), ("b", prompt(1), [good, bad])])
        assert buffer.stats()["answers"] == 0  # all or nothing


def test_ray_shards_own_their_arrays_after_add_and_restore(buffers, tmp_path):
    """Arrays that arrive in a Ray call are read-only views of the call's whole buffer;
    a shard that kept one would pin every answer of that call in the object store."""

    def views(shard):
        store = shard.store
        arrays = {**store.arenas, **store.columns,
                  **{f"prompt of {uid}": entry.prompt_ids for uid, entry in shard.questions.items()}}
        return [name for name, array in arrays.items() if array.base is not None]

    buffer = buffers(2)
    buffer.apply([(f"q{q}", prompt(q), answers_of(q, 4)) for q in range(20)], buckets={f"q{q}": 3 for q in range(20)})
    assert ray.get([s.__ray_call__.remote(views) for s in buffer.shards]) == [[], []]
    buffer.snapshot(tmp_path / "snap")
    restored = buffers(3)
    restored.restore(tmp_path / "snap")
    assert restored.stats()["answers"] == 80
    assert ray.get([s.__ray_call__.remote(views) for s in restored.shards]) == [[], [], []]


# ---------------------------------------------------------------------- retirement


def test_retired_questions_lose_their_answers_and_take_no_more(buffers):
    for shards in (0, 2):
        buffer = buffers(shards, seed=4)
        uids = [f"r{q}" for q in range(12)]
        buffer.apply([(uid, prompt(q), answers_of(q, 3)) for q, uid in enumerate(uids)],
                     buckets={uid: 4 for uid in uids})
        stats = buffer.apply(retire=["r0", "r5"], buckets={"r0": 4})
        assert (stats["questions"], stats["answers"], stats["retired"]) == (10, 30, 2)
        assert stored_of(buffer, ["r0", "r5", "r1"]).keys() == {"r1"}
        assert draw_answers(buffer, [("r0", 2)]) == {"r0": []}
        assert buffer.add([("r0", prompt(0), answers_of(0, 2)), ("r1", prompt(1), [make_answer([1, 2])])]) == 1
        assert buffer.stats()["answers"] == 31
        for _ in range(20):
            drawn = sample_questions(buffer, 100, K, "code")
            assert sorted(drawn) == sorted(set(uids) - {"r0", "r5"})


# ---------------------------------------------------------------------- ExGRPO buckets


def test_bucket_weights_follow_the_gaussian_on_both_scales():
    code = bucket_weights(K, "code")
    assert sorted(code) == list(range(1, K))
    total = sum(code.values())
    probabilities = {k: w / total for k, w in code.items()}
    # sigma = 1 in counts: weight exp(-(k - 4)^2 / 2).
    normaliser = 1 + 2 * (math.exp(-0.5) + math.exp(-2) + math.exp(-4.5))
    for k in range(1, K):
        assert probabilities[k] == pytest.approx(math.exp(-((k - 4) ** 2) / 2) / normaliser, rel=1e-12)
    assert probabilities[4] == pytest.approx(0.399, abs=5e-4)
    assert probabilities[3] == probabilities[5] == pytest.approx(0.242, abs=5e-4)
    assert probabilities[2] == probabilities[6] == pytest.approx(0.054, abs=5e-4)
    assert probabilities[1] == probabilities[7] == pytest.approx(0.0044, abs=5e-5)

    paper = bucket_weights(K, "paper")
    for k in range(1, K):
        assert paper[k] == pytest.approx(math.exp(-((k / K - 0.5) ** 2) / 2), rel=1e-12)
    # Nearly uniform: the extremes k = 1, 7 sit 0.375 from the mean, exp(0.375^2 / 2) = 1.0728.
    ratio = max(paper.values()) / min(paper.values())
    assert ratio == pytest.approx(math.exp(0.375**2 / 2), rel=1e-12) and ratio < 1.075
    wide = bucket_weights(16, "code")
    assert wide[8] == 1.0 and wide[9] == pytest.approx(math.exp(-0.5))
    with pytest.raises(ValueError, match="scale"):
        bucket_weights(K, "accuracy")


def bucketed_buffer(buffer: ReplayBuffer, per_bucket: int) -> tuple[ReplayBuffer, dict[str, int]]:
    buckets = {f"b{k}-{i}": k for k in range(1, K) for i in range(per_bucket)}
    buffer.apply([(uid, prompt(k), answers_of(k, 1)) for uid, k in buckets.items()], buckets=buckets)
    return buffer, buckets


def assert_bucket_frequencies(draws: list[str], buckets: dict[str, int], scale: str):
    weights = bucket_weights(K, scale)
    total = sum(weights.values())
    counts = Counter(buckets[uid] for uid in draws)
    for k in range(1, K):
        p = weights[k] / total
        assert abs(counts[k] / len(draws) - p) <= binomial_tolerance(len(draws), p), (scale, k, counts[k], p)


@pytest.mark.parametrize("scale", ["code", "paper"])
def test_sample_questions_bucket_frequencies_in_process(scale):
    buffer, buckets = bucketed_buffer(ReplayBuffer(0, CAP, seed=5), 200)
    sizes = buffer.bucket_sizes()
    assert sizes == [{k: 200 for k in range(1, K)}]
    draws = []
    for _ in range(6000):
        (uid,) = sample_questions(buffer, 1, K, scale)
        draws.append(uid)
    assert_bucket_frequencies(draws, buckets, scale)
    # Uniform within a bucket: bucket 4's 200 questions, each about equally often.
    in_four = Counter(uid for uid in draws if buckets[uid] == 4)
    assert len(in_four) > 150 and max(in_four.values()) < 40


def test_sample_questions_without_replacement_and_exhaustion():
    buffer, buckets = bucketed_buffer(ReplayBuffer(0, CAP, seed=6), 5)
    for count in (1, 7, 20, 34):
        drawn = sample_questions(buffer, count, K, "code")
        assert len(drawn) == count == len(set(drawn))
    assert sorted(sample_questions(buffer, 35, K, "code")) == sorted(buckets)
    assert sorted(sample_questions(buffer, 1000, K, "paper")) == sorted(buckets)
    # Questions without a bucket in 1..K-1 are never drawn.
    buffer.apply([("nobucket", prompt(0), answers_of(0, 1)), ("zero", prompt(0), answers_of(0, 1)),
                  ("all", prompt(0), answers_of(0, 1))], buckets={"zero": 0, "all": K})
    assert sorted(sample_questions(buffer, 1000, K, "code")) == sorted(buckets)
    assert sample_questions(ReplayBuffer(0, 4), 5, K, "code") == []


def test_a_shards_bucket_index_follows_its_questions_and_draws_as_a_sorted_scan():
    """A shard's per-bucket index, through bucket moves, retirements and a restore, holds what
    a scan of its questions finds; a seeded offer is what `random.sample` of each bucket's
    sorted ids (without the excluded ones) draws with the same seed, in its order."""
    import random

    rng = random.Random(11)
    shard = ReplayShard(CAP)
    uids = [f"q{i:03d}" for i in range(120)]
    rng.shuffle(uids)  # arriving out of id order
    shard.apply(PackedAnswers.pack([(uid, prompt(1), answers_of(1, 1)) for uid in uids]), False, {}, [])

    def scan(exclude=()) -> dict[int, list[str]]:
        members: dict[int, list[str]] = {}
        for uid, entry in shard.questions.items():
            if entry.bucket >= 0 and uid not in exclude:
                members.setdefault(entry.bucket, []).append(uid)
        return {k: sorted(v) for k, v in members.items()}

    for round_ in range(4):
        shard.apply(None, False, {uid: rng.randrange(-1, K + 1) for uid in rng.sample(uids, 60)}, [])
        shard.apply(None, False, {}, rng.sample(sorted(shard.questions), 5))
        if round_ == 2:  # a restored shard indexes what it restored
            exported = shard.export()
            shard = ReplayShard(CAP)
            shard.restore(exported)
        exclude = rng.sample(sorted(shard.questions) + ["not-held"], 20)
        members = scan(exclude)
        assert shard.bucket_sizes(exclude) == {k: len(v) for k, v in members.items()}
        count, wanted = rng.randrange(1, 20), [1, 3, 4, 5, 7]
        expected_rng = np.random.default_rng(round_)
        expected = {k: [members[k][i] for i in expected_rng.choice(len(members[k]), min(count, len(members[k])),
                                                                    replace=False).tolist()]
                    for k in sorted(members) if k in wanted}
        sizes, offers = offer_questions(shard, count, wanted, round_, exclude)
        assert sizes == {k: len(members[k]) for k in expected} and offers == expected


def test_exhausted_buckets_renormalise_over_the_rest():
    """Bucket 4 and bucket 3 hold one question each, bucket 2 many; draw two.

    P(both singletons) = P(4 first) P(3 | 4 gone) + P(3 first) P(4 | 3 gone), with the
    second draw's weights renormalised over the buckets still holding questions."""
    buffer = ReplayBuffer(0, 4, seed=7)
    buckets = {"four": 4, "three": 3} | {f"two-{i}": 2 for i in range(50)}
    buffer.apply([(uid, prompt(0), answers_of(0, 1)) for uid in buckets], buckets=buckets)
    w = bucket_weights(K, "code")
    total = w[4] + w[3] + w[2]
    expected = w[4] / total * w[3] / (w[3] + w[2]) + w[3] / total * w[4] / (w[4] + w[2])
    sizes = buffer.bucket_sizes()
    trials, both = 8000, 0
    for _ in range(trials):
        drawn = sample_questions(buffer, 2, K, "code")
        assert len(set(drawn)) == 2
        both += {"four", "three"} <= set(drawn)
    assert abs(both / trials - expected) <= binomial_tolerance(trials, expected), (both / trials, expected)


@pytest.mark.parametrize("shards", [2, 3])
def test_sample_questions_across_ray_shards(buffers, shards):
    buffer, buckets = bucketed_buffer(buffers(shards, seed=8), 30)
    sizes = buffer.bucket_sizes()
    assert len(sizes) == shards
    for k in range(1, K):
        assert sum(s.get(k, 0) for s in sizes) == 30
    draws = []
    for _ in range(1200):
        (uid,) = sample_questions(buffer, 1, K, "code")
        draws.append(uid)
    assert_bucket_frequencies(draws, buckets, "code")
    # Uniform within bucket 4 whichever shard holds the question: shards drawn by their share.
    in_four = [uid for uid in draws if buckets[uid] == 4]
    for s in range(shards):
        share = sizes[s].get(4, 0) / 30
        observed = sum(shard_of(uid, shards) == s for uid in in_four) / len(in_four)
        assert abs(observed - share) <= binomial_tolerance(len(in_four), share), (s, observed, share)
    for count in (64, 150):
        drawn = sample_questions(buffer, count, K, "paper")
        assert len(drawn) == len(set(drawn)) == min(count, len(buckets))
    assert sorted(sample_questions(buffer, 500, K, "code")) == sorted(buckets)


@pytest.mark.parametrize("shards", [0, 2])
def test_sample_questions_leaves_out_excluded_questions(buffers, shards):
    buffer, buckets = bucketed_buffer(buffers(shards, seed=9), 3)  # 3 per bucket, 21 in all
    excluded = frozenset(uid for uid in buckets if buckets[uid] in (3, 4))  # 6 questions
    assert sum(sum(s.values()) for s in buffer.bucket_sizes(excluded)) == len(buckets) - 6
    for _ in range(20):
        drawn = sample_questions(buffer, 8, K, "code", exclude=excluded)
        assert len(drawn) == 8 and not set(drawn) & excluded
    assert sorted(sample_questions(buffer, 100, K, "code", exclude=excluded)) == sorted(set(buckets) - excluded)


@pytest.mark.parametrize("shards", [0, 2])
def test_answers_by_serial_returns_the_chosen_stored_answers_even_after_other_writes(buffers, shards):
    buffer = buffers(shards)
    contents = {f"p{q}": answers_of(q, 3 + q % 2) for q in range(6)}
    buffer.add([(uid, prompt(q), answers) for q, (uid, answers) in enumerate(contents.items())])
    serials = {uid: own for index, _ in buffer.stored_answers(list(contents)) for uid, own in index}
    positions = {"p0": 2, "p1": 0, "p3": 3, "p4": 1}
    picks = {uid: serials[uid][position] for uid, position in positions.items()}
    # Writes between the read and the pick (another run's, on a shared pool) move rows and
    # retire a picked question: the picks still name the same answers, or none.
    buffer.add([(f"x{q}", prompt(q), answers_of(q, 50)) for q in range(40)])
    buffer.apply(retire=["p4"])
    got = buffer.answers_by_serial(picks)  # each left where it is (`Answer.at`): read from there
    assert got.keys() == {"p0", "p1", "p3"}
    for uid, answer in got.items():
        assert answer.by_reference == (shards > 0)
        [(prompt_ids, response, logprobs, _)] = answer_arrays([answer])
        assert prompt_ids.tolist() == list(prompt(int(uid[1:]))) and answer.length == len(response)
        assert_same_answer(answer, contents[uid][positions[uid]])


# ---------------------------------------------------------------------- stats


def raw_nbytes(prompt_ids, answers) -> int:
    """What one question's storage holds: prompt, tokens, log-probs, tool masks, and per answer an int64
    start, int64 length, int64 serial, int32 owner, its facts (float32 reward, int32 version, int8
    source, int32 step, float32 temperature, int8 verdict, int64 origin, float32 advantage) and its
    int64 row number."""
    tokens = sum(len(a.response_ids) for a in answers)
    n = len(answers)
    return 4 * len(prompt_ids) + 4 * tokens + 4 * tokens + tokens + (8 + 8 + 8 + 4 + (4 + 4 + 1 + 4 + 4 + 1 + 8 + 4) + 8) * n


def test_stats_count_questions_answers_bytes_buckets_and_age(buffers):
    contents = {
        "a": (np.arange(7, dtype=np.int32), [make_answer(range(10), step=3), make_answer(range(4), step=5)]),
        "b": (np.arange(2, dtype=np.int32), [make_answer(range(33), step=9)]),
        "c": (np.arange(5, dtype=np.int32), [make_answer([i] * (i + 1), step=1) for i in range(CAP + 1)]),
    }
    for shards in (0, 2, 3):
        buffer = buffers(shards)
        stats = buffer.apply([(uid, p, a) for uid, (p, a) in contents.items()],
                             buckets={"a": 2, "b": 2, "c": 6}, retire=["z"])
        # "c" keeps its CAP newest answers (lengths 2..CAP + 1); its first one is evicted.
        kept = {"a": contents["a"][1], "b": contents["b"][1], "c": contents["c"][1][1:]}
        assert stats["stored"] == 3 + CAP + 1
        full = buffer.stats(now_step=10)
        for s in (stats, full):
            assert (s["questions"], s["answers"], s["retired"], s["evicted"]) == (3, 3 + CAP, 1, 1)
            assert s["buckets"] == {2: 2, 6: 1}
            assert s["bytes"] == sum(raw_nbytes(contents[u][0], kept[u]) for u in kept)
        ages = [10 - 3, 10 - 5, 10 - 9] + [10 - 1] * CAP
        assert full["age_mean"] == pytest.approx(sum(ages) / len(ages)) and full["age_max"] == 9
        assert "age_mean" not in buffer.stats()


# ---------------------------------------------------------------------- snapshots


def filled_buffer() -> ReplayBuffer:
    """25 questions (3 of them retired) with 1..11 answers, some evicted, some buckets set."""
    buffer = ReplayBuffer(0, CAP, seed=9)
    items = []
    for q in range(25):
        answers = [make_answer([q, i] + [3] * (q % 5), reward=0.5 * i, version=q, source=("pool", "online")[i % 2],
                               step=q + i)
                   for i in range(1 + q % 11)]
        if q % 4 == 0:
            answers[0].logprobs[:] = np.nan  # text-only pool answers
        items.append((f"s{q:02d}", np.arange(q % 3 + 1, dtype=np.int32) + q, answers))
    buffer.apply(items, buckets={f"s{q:02d}": q % K for q in range(0, 25, 2)}, retire=["s03", "s07", "never-stored"])
    return buffer


def buffer_content(buffer: ReplayBuffer, uids):
    stats = buffer.stats(now_step=100)
    content = {
        uid: (p.tolist(), [(a.response_ids.tolist(), a.logprobs.tobytes(), a.reward, a.version, a.source, a.step)
                           for a in answers])
        for uid, (p, answers) in stored_of(buffer, uids).items()
    }
    merged_buckets = Counter()
    for sizes in buffer.bucket_sizes():
        merged_buckets.update(sizes)
    counters = ("questions", "answers", "retired", "evicted", "bytes", "age_mean")
    return content, dict(merged_buckets), {k: stats[k] for k in counters}


def test_snapshot_round_trip_is_byte_identical_across_shard_counts(buffers, tmp_path):
    uids = [f"s{q:02d}" for q in range(25)]
    original = filled_buffer()
    assert original.stats()["evicted"] == 2 * (1 + 2 + 3) and original.stats()["retired"] == 3
    reference = buffer_content(original, uids)
    original.snapshot(tmp_path / "one")
    previous = tmp_path / "one"
    for step, shards in enumerate((2, 0, 3)):
        restored = buffers(shards)
        restored.restore(previous)
        assert buffer_content(restored, uids) == reference
        # Retired questions stay retired after a restore.
        assert restored.add([("s03", prompt(3), answers_of(3, 1))]) == 0
        target = tmp_path / f"again-{step}"
        restored.snapshot(target)
        for name in ("answers.parquet", "questions.parquet"):
            assert (target / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), (shards, name)
        previous = target
    # Snapshot over an existing one: replaced, still readable, nothing left behind.
    original.add([("s01", prompt(1), answers_of(1, 1))])
    original.snapshot(tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["answers.parquet", "questions.parquet"]
    snapshot = read_snapshot(tmp_path / "one")
    assert (len(snapshot.questions), snapshot.retired, snapshot.evicted) == (23, ["never-stored", "s03", "s07"],
                                                                           reference[2]["evicted"])
    assert len(dict(snapshot.questions)["s01"]) == 3


def test_large_files_are_written_and_read_in_row_groups(monkeypatch, tmp_path):
    """Files are written in row groups of about _ROWS_PER_CHUNK rows (whole questions where
    they fit, else a question straddles groups) and list columns in Arrow chunks of at most
    _MAX_LIST_VALUES values, and read back one row group at a time: shrunk here so that a
    small buffer takes every path."""
    from rayrep.buffer import files

    monkeypatch.setattr(files, "_ROWS_PER_CHUNK", 4)
    monkeypatch.setattr(files, "_MAX_LIST_VALUES", 10)
    uids = [f"s{q:02d}" for q in range(25)]
    original = filled_buffer()
    reference = buffer_content(original, uids)
    original.snapshot(tmp_path / "a")
    assert pq.ParquetFile(tmp_path / "a" / "answers.parquet").metadata.num_row_groups >= reference[2]["answers"] // 4
    restored = ReplayBuffer(0, CAP)
    restored.restore(tmp_path / "a")
    assert buffer_content(restored, uids) == reference
    restored.snapshot(tmp_path / "b")
    for name in ("answers.parquet", "questions.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    rows = pool_rows()
    path = write_pool(rows, tmp_path / "pool.parquet", source_checkpoint="x")
    assert pq.ParquetFile(path).metadata.num_row_groups == 2  # p-a's rows in both
    assert_pool_matches(read_pool(path), rows)


def test_restoring_a_snapshot_holds_about_its_raw_size(tmp_path):
    rng = np.random.default_rng(3)
    questions, answers, length = 16, 64, 256
    buffer = ReplayBuffer(0, answers)
    buffer.add([(f"r{q}", np.arange(100, dtype=np.int32), long_answers(q, answers, length, rng))
                for q in range(questions)])
    buffer.snapshot(tmp_path)
    raw = questions * answers * length * 8
    restored = ReplayBuffer(0, answers)
    tracemalloc.start()
    try:
        restored.restore(tmp_path)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert restored.stats() == buffer.stats()
    # Python objects per token (about 30 bytes each against 8 raw) would show up here.
    assert current <= 1.2 * raw + 2048 * questions and peak <= 3 * raw, (current, peak, raw)


def rewrite_metadata(path, **changes):
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    for key, value in changes.items():
        name = key.replace("_", ".", 1).encode()
        if value is None:
            meta.pop(name, None)
        else:
            meta[name] = value.encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


@pytest.mark.parametrize("file", ["answers.parquet", "questions.parquet"])
@pytest.mark.parametrize(
    "change, message",
    [
        ({"rayrep_kind": "experience-pool"}, "not a rayrep buffer-snapshot file"),
        ({"rayrep_schema_version": "5"}, "schema version 5, this rayrep reads versions 1 to 4"),
        ({"rayrep_schema_version": "one"}, "is not a number"),
        ({"rayrep_schema_version": None}, "no rayrep.schema_version"),
    ],
)
def test_snapshot_with_wrong_kind_or_version_is_refused(tmp_path, file, change, message):
    filled_buffer().snapshot(tmp_path)
    rewrite_metadata(tmp_path / file, **change)
    with pytest.raises(BufferFileError, match=message) as err:
        ReplayBuffer(0, 4).restore(tmp_path)
    assert str(tmp_path / file) in str(err.value)


def test_missing_or_unreadable_snapshot_files_are_named(tmp_path):
    filled_buffer().snapshot(tmp_path)
    (tmp_path / "questions.parquet").unlink()
    with pytest.raises(BufferFileError, match="no such file") as err:
        ReplayBuffer(0, 4).restore(tmp_path)
    assert str(tmp_path / "questions.parquet") in str(err.value)
    (tmp_path / "answers.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(BufferFileError, match="not a readable Parquet file") as err:
        ReplayBuffer(0, 4).restore(tmp_path)
    assert str(tmp_path / "answers.parquet") in str(err.value)
    with pytest.raises(BufferFileError, match="no such file"):
        ReplayBuffer(0, 4).restore(tmp_path / "nowhere")


# ---------------------------------------------------------------------- experience pools


def pool_rows():
    rng = np.random.default_rng(0)
    rows = []
    # Rows of a question need not be next to each other: p-a, p-b, p-a, p-c, p-a, p-c.
    for q, i in (("p-a", 0), ("p-b", 0), ("p-a", 1), ("p-c", 0), ("p-a", 2), ("p-c", 1)):
        length = 3 + 2 * i
        rows.append({
            "uid": q, "prompt": [{"role": "user", "content": f"question {q}"}], "ground_truth": "42",
            "data_source": "test", "prompt_ids": np.array([1, 2, len(rows)], np.int32),
            "response_ids": rng.integers(0, 2**31 - 1, length).astype(np.int32),
            "logprobs": (-rng.random(length) * 10).astype(np.float32),
            "text": f"answer {i}", "reward": 1.0, "version": 7 + i,
        })
    return rows


def assert_pool_matches(pool, rows):
    """Questions in order of first appearance, each with its rows' answers in file order."""
    assert list(pool) == ["p-a", "p-b", "p-c"]
    for uid, (prompt_ids, answers) in pool.items():
        mine = [r for r in rows if r["uid"] == uid]
        assert prompt_ids.dtype == np.int32 and prompt_ids.tolist() == mine[0]["prompt_ids"].tolist()
        assert len(answers) == len(mine)
        for answer, row in zip(answers, mine):
            assert_same_answer(answer, Answer.of_arrays(row["response_ids"], row["logprobs"], 1.0, row["version"], "pool", 0))


def test_pool_round_trip_keeps_int32_ids_and_float32_logprobs_exactly(tmp_path):
    rows = pool_rows()
    path = write_pool(rows, tmp_path / "pool.parquet", source_checkpoint="ckpt/step-400")
    pool = read_pool(path)
    assert_pool_matches(pool, rows)
    table = pq.read_table(path)
    assert table.column("source_checkpoint").to_pylist() == ["ckpt/step-400"] * len(rows)
    assert table.column("length").to_pylist() == [len(r["response_ids"]) for r in rows]
    # Pool answers enter a buffer as they are.
    buffer = ReplayBuffer(0, 64)
    assert buffer.add([(uid, p, a) for uid, (p, a) in pool.items()]) == len(rows)


def test_pool_rows_with_mismatched_logprobs_are_rejected_naming_the_row(tmp_path):
    rows = pool_rows()
    rows[4]["logprobs"] = rows[4]["logprobs"][:-1]
    with pytest.raises(BufferFileError, match="row 5: 7 token ids but 6 log-probs"):
        write_pool(rows, tmp_path / "bad.parquet", source_checkpoint="x")
    # A file written by other means is refused on reading, naming file and row.
    good = pq.read_table(write_pool(pool_rows(), tmp_path / "good.parquet", source_checkpoint="x"))
    logprobs = good.column("logprobs").to_pylist()
    logprobs[3] = logprobs[3] + [0.0]
    column = good.schema.get_field_index("logprobs")
    bad = good.set_column(column, "logprobs", pa.array(logprobs, pa.list_(pa.float32())))
    pq.write_table(bad.replace_schema_metadata(good.schema.metadata), tmp_path / "bad.parquet")
    with pytest.raises(BufferFileError, match=r"bad.parquet, row 4: 3 token ids but 4 log-probs"):
        read_pool(tmp_path / "bad.parquet")


def test_pool_with_wrong_kind_or_version_or_missing_is_refused(tmp_path):
    path = write_pool(pool_rows(), tmp_path / "pool.parquet", source_checkpoint="x")
    rewrite_metadata(path, rayrep_schema_version="9")
    with pytest.raises(BufferFileError, match="pool.parquet: experience-pool schema version 9"):
        read_pool(path)
    filled_buffer().snapshot(tmp_path / "snap")
    with pytest.raises(BufferFileError, match="answers.parquet: not a rayrep experience-pool file"):
        read_pool(tmp_path / "snap" / "answers.parquet")
    with pytest.raises(BufferFileError, match="missing.parquet: no such file"):
        read_pool(tmp_path / "missing.parquet")
    # What a pool file holds, read back from the file (not the constant it was written with):
    # float32 log-probs, as the shards keep them, so that a replayed ratio is the recorded one.
    written = pq.read_schema(write_pool(pool_rows(), tmp_path / "again.parquet", source_checkpoint="x"))
    assert written.field("logprobs").type == pa.list_(pa.float32())
    assert written.field("response_ids").type.value_type == pa.int32()


def write_dapo_rows(path, candidates, candidate_type=pa.list_(pa.string())):
    rows = len(candidates)
    table = pa.table({
        "data_source": ["math_dapo"] * rows,
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(rows)],
        "ability": ["MATH"] * rows,
        "reward_model": pa.array(
            [{"ground_truth": str(2 * i), "style": "rule", "candidates": c} for i, c in enumerate(candidates)],
            pa.struct([("ground_truth", pa.string()), ("style", pa.string()), ("candidates", candidate_type)]),
        ),
        "extra_info": [{"index": f"dapo-{i}"} for i in range(rows)],
    })
    pq.write_table(table, path)


def test_import_text_pool_tokenizes_candidates_with_eos_and_nan_logprobs(tmp_path):
    from rayrep.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    candidates = [["2", "so it is 2"], ["The answer is 4.", "4", "ünï"]]
    write_dapo_rows(tmp_path / "dapo.parquet", candidates)
    imported = import_text_pool(tmp_path / "dapo.parquet", tokenizer, tmp_path / "pool.parquet")
    assert (imported.candidates, imported.questions, imported.questions_without) == (5, 2, 0)
    path = imported.path
    pool = read_pool(path)
    assert list(pool) == ["dapo-0", "dapo-1"]
    for i, uid in enumerate(pool):
        prompt_ids, answers = pool[uid]
        assert tokenizer.decode(prompt_ids) == f"Q: What is {i} + {i}?\nA: "
        assert len(answers) == len(candidates[i])
        for answer, text in zip(answers, candidates[i]):
            ids = answer.response_ids
            # One token per byte (a char tokenizer), then end-of-sequence.
            assert ids.dtype == np.int32 and len(ids) == len(text.encode()) + 1
            assert ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in ids[:-1]
            assert tokenizer.decode(ids[:-1]) == text
            assert answer.logprobs.dtype == np.float32 and len(answer.logprobs) == len(ids)
            assert np.isnan(answer.logprobs).all()
            assert (answer.reward, answer.source) == (1.0, "pool")
    table = pq.read_table(path)
    assert table.column("text").to_pylist() == [c for row in candidates for c in row]
    assert table.column("source_checkpoint").to_pylist()[0] == "imported:dapo.parquet"
    short = import_text_pool(tmp_path / "dapo.parquet", tokenizer, tmp_path / "short.parquet", max_response_tokens=3)
    lengths = [len(a.response_ids) for _, answers in read_pool(tmp_path / "short.parquet").values() for a in answers]
    assert short.candidates == 5 and lengths == [2, 3, 3, 2, 3]


def test_import_text_pool_takes_null_candidates_as_no_successes(tmp_path):
    """Rows in the released pool's shape: DAPO-Math rows whose `reward_model.candidates` is a
    list of strings, or null for a question without successes."""
    from rayrep.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    write_dapo_rows(tmp_path / "released.parquet", [["1"], None, ["3", "three"], []])
    imported = import_text_pool(tmp_path / "released.parquet", tokenizer, tmp_path / "pool.parquet")
    assert (imported.candidates, imported.questions, imported.questions_without) == (3, 4, 2)
    assert list(read_pool(imported.path)) == ["dapo-0", "dapo-2"]
    write_dapo_rows(tmp_path / "empty.parquet", [None, []])
    with pytest.raises(PromptFileError, match="empty.parquet: none of its 2 questions has a candidate answer"):
        import_text_pool(tmp_path / "empty.parquet", tokenizer, tmp_path / "out.parquet")


def test_import_text_pool_rejects_rows_without_string_candidates(tmp_path):
    from rayrep.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    write_dapo_rows(tmp_path / "numbers.parquet", [[1, 2]], candidate_type=pa.list_(pa.int64()))
    with pytest.raises(PromptFileError, match=r"numbers.parquet, row 1: field 'reward_model.candidates'"):
        import_text_pool(tmp_path / "numbers.parquet", tokenizer, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


# ---------------------------------------------------------------------- memory


def long_answers(question: int, count: int, length: int, rng) -> list[Answer]:
    return [Answer.of_arrays(rng.integers(0, 50_000, length).astype(np.int32), (-rng.random(length)).astype(np.float32), 1.0, 0,
                   "online", question)
            for _ in range(count)]


def test_stats_bytes_stay_close_to_the_raw_arrays():
    rng = np.random.default_rng(1)
    buffer = ReplayBuffer(0, 64)
    questions, answers, length, prompt_length = 8, 64, 256, 100
    for q in range(questions):
        buffer.add([(f"m{q}", np.arange(prompt_length, dtype=np.int32), long_answers(q, answers, length, rng))])
    raw = questions * answers * length * (4 + 4 + 1)  # token id, log-prob, tool mask
    held = buffer.stats()["bytes"]
    per_question = 4 * prompt_length + (8 + 8 + 8 + 4 + (4 + 4 + 1 + 4 + 4 + 1 + 8 + 4) + 8) * answers
    assert held == raw + questions * per_question
    assert held <= 1.2 * raw + questions * 2048


def test_process_memory_growth_of_an_in_process_shard():
    rng = np.random.default_rng(2)
    answers_per_question, length = 64, 256
    batches = [(f"t{q}", np.arange(100, dtype=np.int32), long_answers(q, answers_per_question, length, rng))
               for q in range(32)]
    raw = len(batches) * answers_per_question * length * 9  # 2,048 answers: 4.5 MiB of tokens, log-probs, tool masks
    shard = ReplayShard(64)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for item in batches:
            shard.apply(PackedAnswers.pack([item]), False, {}, [])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert shard.stats()["answers"] == 2048
    assert raw <= grown <= 1.2 * raw + 2048 * len(batches), (grown, raw)


# ---------------------------------------------------------------------- answer-level replay


def scored_answers(question: int, advantages: list[float], versions: list[int]) -> list[Answer]:
    """Answers of `question` (answer i starts with token 1000 * question + i) with these
    advantages and sampling policy versions."""
    return [answer._replace(advantage=advantage, version=version)
            for answer, advantage, version in zip(answers_of(question, len(advantages)), advantages, versions)]


def drawn_ids(drawn) -> list[tuple[str, int]]:
    """(question, first token) of each drawn answer, in the order drawn, read where it is."""
    return [(uid, int(answer.response_ids[0])) for uid, answer in drawn]


def test_priorities_are_the_advantage_size_decayed_by_age():

    got = priorities(np.array([0.5, -1.0, 2.0, 1.0]), np.array([0, 4, 8, -3]), 4.0)
    assert np.allclose(got, [0.5, math.exp(-1), 2 * math.exp(-2), 1.0])  # a newer policy's answer: age 0
    assert np.allclose(priorities(np.array([-3.0, 1.0]), np.array([100, 0]), 0.0), [3.0, 1.0])  # no decay


def test_answer_level_draws_follow_priority_without_replacement_and_evict_by_age():
    """A hand-computed case at policy version 4, tau = 4, max age 3: q1's answers have
    |A| x exp(-age / 4) = 1 (version 4), e^-0.75 (version 1, A = -1) and 0 (A = 0: never drawn);
    q2's 0.5; q3's answer is 4 versions old, past the bound. One answer drawn at a time, each
    is drawn with probability priority / sum; more at once, each once."""
    buffer = ReplayBuffer(0, 0, seed=3)
    buffer.add([("q1", prompt(1), scored_answers(1, [1.0, -1.0, 0.0], [4, 1, 4])),
                ("q2", prompt(2), scored_answers(2, [0.5], [4])), ("q3", prompt(3), scored_answers(3, [2.0], [0]))])
    weights = {("q1", 1000): 1.0, ("q1", 1001): math.exp(-0.75), ("q2", 2000): 0.5}
    n = 3000
    firsts = Counter(drawn_ids(race_answers(buffer, 1, 4, 4.0, 3))[0] for _ in range(n))
    assert set(firsts) == set(weights)
    for key, weight in weights.items():
        p = weight / sum(weights.values())
        assert abs(firsts[key] / n - p) <= binomial_tolerance(n, p), (key, firsts[key] / n, p)
    every = drawn_ids(race_answers(buffer, 10, 4, 4.0, 3))
    assert sorted(every) == sorted(weights)  # all there are, each once
    assert drawn_ids(race_answers(buffer, 10, 4, 4.0, 3, exclude=frozenset({"q1"}))) == [("q2", 2000)]
    assert sorted(drawn_ids(race_answers(buffer, 10, 4, 4.0, -1))) == sorted([*weights, ("q3", 3000)])

    # Eviction: this run's answers (origin: none here) sampled before version 2 leave; q3, left
    # with none, goes too.
    stats = buffer.apply(evict=(0, 2))
    assert (stats["answers"], stats["evicted"], stats["questions"]) == (3, 2, 2)
    assert sorted(drawn_ids(race_answers(buffer, 10, 4, 4.0, -1))) == [("q1", 1000), ("q2", 2000)]
    assert buffer.apply(evict=(12345, 9))["answers"] == 3  # another origin's answers stay


def test_answer_level_draws_across_shards_repeat_after_a_restore(buffers, tmp_path):
    """A resumed run draws what the uninterrupted one did: the shards restored from the
    snapshot, the client's random state as saved, the same draws, and after the same writes
    (and evictions) the same again."""
    buffer = buffers(2, seed=5)
    rng = np.random.default_rng(0)

    def items(questions, version):
        return [(f"q{q}", prompt(q), scored_answers(q, rng.normal(size=4).tolist(), [version] * 4)) for q in questions]

    first, later = items(range(20, 0, -1), 0), items(range(10, 30), 1)
    buffer.add(first)
    buffer.add(items(range(40, 30, -1), 1))
    buffer.snapshot(tmp_path)
    saved = buffer.rng.getstate()

    def draws():
        one = drawn_ids(race_answers(buffer, 12, 2, 2.0, -1, exclude=frozenset({"q3", "q12"})))
        buffer.apply(later, evict=(0, 1))
        return one, drawn_ids(race_answers(buffer, 12, 2, 2.0, -1))

    uninterrupted = draws()
    assert len(set(uninterrupted[0])) == 12 and not {"q3", "q12"} & {uid for uid, _ in uninterrupted[0]}
    assert all(uid in {f"q{q}" for q in range(10, 41)} for uid, _ in uninterrupted[1])  # version 0 evicted
    buffer.restore(tmp_path)
    buffer.rng.setstate(saved)
    assert draws() == uninterrupted


def test_draws_load_without_torch_where_the_shards_run_them():
    """A shard unpickles an algorithm's draw by importing its module: the draws' package
    must not pull in torch (or the rest of the algorithms) with it."""
    import subprocess
    import sys

    code = ("import sys; import rayrep.algos.sampling.rlep, rayrep.algos.sampling.exgrpo, "
            "rayrep.algos.sampling.prioritized; print(sorted(m for m in ('torch', 'vllm', 'rayrep.algos.grpo') "
            "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
