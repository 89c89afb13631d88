"""A verifier actor that dies loses no work and hangs nothing, on a real local Ray cluster.

The pool's verifiers sit in their placement group's bundles, as in a run. A verifier is
killed between checks (`ray.kill`) and in the middle of one (SIGKILL to its process): the
check still returns every verdict, the ones the formula gives, and counts the replacement
and the completions sent again. A share that kills every verifier it reaches ends, after
the bounded retries, in an error naming the verifier, and the pool goes on working.
"""

import os
import signal
import threading
import time

import pytest
import ray

from conftest import kill_and_wait
from rayrep.cluster.placement import Placement, make_plan
from rayrep.cluster.supervisor import MAX_RETRIES
from rayrep.generator.group import PendingRollouts
from rayrep.types import Prompt, Rollout
from rayrep.verifier.group import VerifierGroup


def share(texts_per_prompt, start=0):
    rollouts = [[Rollout([1], [2], [0.0], text, "stop") for text in texts] for texts in texts_per_prompt]
    return PendingRollouts(range(start, start + len(rollouts)), ray.put(rollouts))


def math_question(q: int) -> Prompt:
    return Prompt(str(q), ({"role": "user", "content": f"question {q}"},), str(q), "math")


def questions(count, answers_each, start=0):
    """Prompt q (from `start`) has truth q; its answer j is `q + j` (right for j = 0 only),
    written as a fraction so that math-verify, in the sandbox, does the comparing."""
    texts = [[f"so \\boxed{{\\frac{{{2 * (q + j)}}}{{2}}}}" for j in range(answers_each)]
             for q in range(start, start + count)]
    truths = [math_question(q) for q in range(start, start + count)]
    expected = [[j == 0 for j in range(answers_each)] for _ in range(count)]
    return texts, truths, expected


@pytest.fixture(scope="module")
def placed(ray_cluster, tiny_cfg):
    cfg = tiny_cfg.replace(**{"verifier.num_workers": 2, "verifier.timeout_s": 1.0})
    placement = Placement(make_plan(cfg, learners=False))
    pool = VerifierGroup.create(cfg, placement)
    yield pool, placement
    pool.shutdown()
    for worker in pool.workers:
        ray.kill(worker)
    placement.remove()


def bundle_in_use(placement, index, timeout_s=30.0) -> bool:
    """Whether verifier bundle `index` has its CPU taken by an actor (Ray reports free
    bundle resources as `CPU_group_<index>_<group id>`; its view settles within a second)."""
    key = f"CPU_group_{index}_{placement.groups['verifiers'].id.hex()}"
    assert key in ray.cluster_resources()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get(key, 0.0) < 1e-6:
            return True
        time.sleep(0.2)
    return False


def test_a_verifier_killed_between_checks_is_replaced_in_its_bundle(placed):
    pool, placement = placed
    first, first_truths, first_expected = questions(3, 4)
    second, second_truths, second_expected = questions(2, 3, start=3)
    shares = [share(first), share(second, start=3)]
    undisturbed = pool.check(shares, first_truths + second_truths)
    assert undisturbed.correct == first_expected + second_expected
    assert undisturbed.statuses == {"ok": 18}

    dead = pool.workers[0]
    dead_pid = ray.get(dead.pid.remote())
    kill_and_wait(dead)
    verdicts = pool.check(shares, first_truths + second_truths)
    assert verdicts.correct == undisturbed.correct
    # The 12 completions of the dead verifier's share were sent once more, to its replacement.
    assert verdicts.statuses == {"ok": 18, "replaced": 1, "retried_items": 12}
    assert pool.workers[0] is not dead and ray.get(pool.workers[0].pid.remote()) != dead_pid
    assert bundle_in_use(placement, 0), "the replacement does not hold the dead verifier's bundle"
    # The next check runs on the healthy pool again, with nothing to count.
    assert pool.check(shares, first_truths + second_truths).statuses == {"ok": 18}


def test_a_verifier_killed_in_the_middle_of_a_check_loses_nothing(placed):
    pool, _ = placed

    def shares_of(start):
        big, big_truths, big_expected = questions(300, 5, start)  # 1500 completions: seconds of math-verify
        small, small_truths, small_expected = questions(2, 2, start + 300)
        return [share(big), share(small, start=300)], big_truths + small_truths, big_expected + small_expected

    # How long a share this size takes, on other questions (a worker remembers what it parsed).
    shares, truths, _ = shares_of(2000)
    start = time.monotonic()
    pool.check(shares, truths)
    undisturbed_s = time.monotonic() - start

    # Verifier 0 dies a third of the way through the big share.
    shares, truths, expected = shares_of(1000)
    pid = ray.get(pool.workers[0].pid.remote())
    killer = threading.Timer(undisturbed_s / 3, os.kill, (pid, signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    verdicts = pool.check(shares, truths)
    killer.join()
    assert time.monotonic() - start > undisturbed_s / 3  # the check was still running when it died
    assert verdicts.correct == expected
    assert verdicts.statuses == {"ok": 1504, "replaced": 1, "retried_items": 1500}
    assert ray.get(pool.workers[0].pid.remote()) != pid
    # The same as the same items scored by a pool that lost nothing.
    undisturbed = pool.check(shares, truths)
    assert (undisturbed.correct, undisturbed.statuses) == (verdicts.correct, {"ok": 1504})


class KillsItsReader:
    """Unpickling this ends the reading process at once, as a verifier killed by whatever
    it was sent would end (os._exit is importable in every process: no test module needed)."""

    def __reduce__(self):
        return os._exit, (1,)


@pytest.mark.timeout(300)  # a hang fails here instead of at the suite's limit
def test_a_share_that_kills_every_verifier_ends_in_a_clear_error(placed):
    pool, _ = placed
    deadly = PendingRollouts(range(0, 1), ray.put([[KillsItsReader()]]))
    texts, truths, expected = questions(1, 2, start=1)
    with pytest.raises(RuntimeError, match=rf"verifier 0 died {MAX_RETRIES + 1} times .*ActorDiedError"):
        pool.check([deadly, share(texts, start=1)], [math_question(1)] + truths)
    # The pool still works: the last dead verifier is replaced on the next check.
    verdicts = pool.check([share(texts), share(texts, start=1)], truths * 2)
    assert verdicts.correct == expected * 2
    assert verdicts.statuses == {"ok": 4, "replaced": 1, "retried_items": 2}


@ray.remote(num_cpus=0)
class Generator:
    def rollouts(self):
        return [[Rollout([1], [2], [0.0], "\\boxed{1}", "stop")]]


def test_a_share_lost_upstream_is_not_taken_for_a_verifier_death(placed):
    pool, _ = placed
    generator = Generator.remote()
    ray.get(generator.rollouts.remote())
    kill_and_wait(generator)
    lost = PendingRollouts(range(0, 1), generator.rollouts.remote())  # its generator is gone
    workers, pids = list(pool.workers), ray.get([w.pid.remote() for w in pool.workers])
    with pytest.raises(ray.exceptions.RayActorError):
        pool.check([lost], [math_question(1)])
    assert pool.workers == workers and ray.get([w.pid.remote() for w in pool.workers]) == pids
