"""A generator (vLLM engine actor) that dies loses no prompts and hangs nothing, on a real local Ray cluster.

Two generators sit in their placement group's bundles, as in a run. One is SIGKILLed in the
middle of a generate call: `GeneratorGroup.complete` starts a replacement in the dead one's
bundle and asks it the dead one's prompts whose answers had not arrived; with per-prompt
seeds every answer is the one an undisturbed call gives. With learners and a weight sync, the replacement joins a
rebuilt weight group and samples from the learners' current weights at the current policy
version; one that the weight sync finds dead is replaced by the sync. (In a real training run,
tests/test_resume.py kills a generator during a step's generation: the run logs what an
undisturbed run logs, plus the replacement's counts.)
"""

import os
import signal
import threading
import time
from collections import Counter

import pytest
import ray

from conftest import kill_and_wait
from rayrep.cluster.placement import Placement, make_plan, weight_transport
from rayrep.data import encode_prompts, load_split
from rayrep.generator.group import GeneratorGroup
from rayrep.roles.system import Runtime
from rayrep.types import LossSpec
from test_learner_and_sync import synthetic_batch


SHARE = 16
"""Prompts each of two generators answers in the death test's calls."""


def two_generators(cfg):
    return cfg.replace(**{"generator.num_workers": 2, "placement.cpus_per_bundle": 1, "placement.threads": 1,
                          "verifier.num_workers": 0})


def questions(cfg, tiny_policy, count):
    from transformers import AutoTokenizer

    prompts = load_split(cfg.data, "train")[:count]
    return encode_prompts(AutoTokenizer.from_pretrained(tiny_policy), prompts, cfg.data.max_prompt_tokens)


def free_in_bundles(placement, count: int, settle_s: float = 30.0) -> list[float]:
    """The CPU left free in each of the generators' `count` bundles (Ray reports it as
    `CPU_group_<index>_<group id>`), once no actor is starting or stopping in them."""
    group = placement.groups[placement.plan.slots["generator"][0].group]
    keys = [f"CPU_group_{i}_{group.id.hex()}" for i in range(count)]
    deadline, last = time.monotonic() + settle_s, None
    while time.monotonic() < deadline:  # Ray's view settles within a second or so
        free = [ray.available_resources().get(key, 0.0) for key in keys]
        if free == last:
            return free
        last = free
        time.sleep(1.0)
    return last


def sample(generators, prompt_ids, seeds, counts=None, kill_after_s=None):
    """Every prompt's rollouts from one generate call made whole by `complete`; `kill_after_s`:
    SIGKILL generator 1's process that long after the call started."""
    killer = None
    if kill_after_s is not None:  # (asked first: the actor answers once its calls before are done)
        killer = threading.Timer(kill_after_s, os.kill, (ray.get(generators.workers[1].pid.remote()), signal.SIGKILL))
    pending = generators.generate(prompt_ids, n=8, temperature=1.0, top_p=1.0, max_tokens=48, seeds=seeds)
    if killer is not None:
        killer.start()
    done, held = generators.complete(pending, counts)
    if killer is not None:
        killer.join()
    rollouts = generators.read(done)  # the parts' refs: those the verifiers read
    # What the driver holds of them: their facts, and where they are.
    assert [[(a.length, a.finish_reason, a.version) for a in answers] for answers in held] == \
        [[(len(r.response_ids), r.finish_reason, r.version) for r in answers] for answers in rollouts]
    return rollouts


def test_a_generator_killed_in_the_middle_of_a_call_is_replaced_and_its_prompts_sampled_again(
        ray_cluster, tiny_cfg, tiny_policy):
    cfg = two_generators(tiny_cfg)
    placement = Placement(make_plan(cfg, learners=False))
    generators = GeneratorGroup.create(cfg, tiny_policy, placement)
    try:
        prompt_ids = questions(cfg, tiny_policy, 2 * SHARE)
        seeds = cfg.sampling_seeds("deaths", len(prompt_ids))
        sample(generators, prompt_ids, cfg.sampling_seeds("warm-up", len(prompt_ids)))  # the engines' first call
        counts = Counter()
        start = time.monotonic()
        undisturbed = sample(generators, prompt_ids, seeds, counts)
        undisturbed_s = time.monotonic() - start
        assert counts == {}

        dead, occupied = generators.workers[1], free_in_bundles(placement, 2)
        assert occupied == [0.5, 0.5]  # each generator takes half of its bundle (the learner's half is free)
        dead_pid = ray.get(dead.pid.remote())
        start = time.monotonic()
        recovered = sample(generators, prompt_ids, seeds, counts, kill_after_s=undisturbed_s / 3)
        assert time.monotonic() - start > undisturbed_s / 3  # the call was still running when it died
        assert counts == {"replaced": 1, "retried_prompts": SHARE}  # generator 1's share: the second half
        assert [len(rollouts) for rollouts in recovered] == [8] * (2 * SHARE)
        assert recovered == undisturbed  # the same tokens, log-probs and texts: the seeds decide them
        replacement = generators.workers[1]
        assert replacement is not dead and ray.get(replacement.pid.remote()) != dead_pid
        assert free_in_bundles(placement, 2) == occupied  # the replacement took the dead one's bundle
        assert ray.get([w.policy_version.remote() for w in generators.workers]) == [0, 0]
        # The next call runs on the healthy pool again, with nothing to count.
        counts = Counter()
        assert sample(generators, prompt_ids, seeds, counts) == undisturbed and counts == {}

        # Answers in parts (8 per share): generator 1 killed as its first part arrives keeps
        # what arrived; only its unanswered prompts go to the replacement, each prompt answered once.
        victim, first = ray.get(generators.workers[1].pid.remote()), []

        def kill_on_first_part(part):
            if min(part.indices) >= SHARE and not first:  # generator 1's share
                first.append(list(part.indices))
                os.kill(victim, signal.SIGKILL)

        counts = Counter()
        shares = generators.generate(prompt_ids, n=8, temperature=1.0, top_p=1.0, max_tokens=48, seeds=seeds, parts=8)
        parts, _ = generators.complete(shares, counts, kill_on_first_part)
        assert generators.read(parts) == undisturbed
        assert sorted(i for part in parts for i in part.indices) == list(range(2 * SHARE))  # none answered twice
        assert counts["replaced"] == 1 and 0 < counts["retried_prompts"] <= SHARE - len(first[0])
    finally:
        for worker in generators.workers:
            ray.kill(worker)
        placement.remove()


def train_once(runtime, seed: int = 0) -> dict:
    """One update and sync, in the order the driver takes them (`rayrep.train`): where the
    roles take turns, the engines sleep for it and the learners' state moves."""
    runtime.hand_over_to_learners()
    runtime.learners.update(synthetic_batch(seed=seed), LossSpec())
    pushed = runtime.sync_weights()
    runtime.hand_over_to_generators()
    return pushed


@pytest.mark.parametrize(("learner_ranks", "transport"), [(1, "broadcast"), (2, "handles")])
def test_a_replacement_joins_a_rebuilt_weight_group_and_samples_the_current_policy(
        ray_cluster, tiny_cfg, tiny_policy, learner_ranks, transport):
    """The learners moved the policy away from the checkpoint (version 1): the replacement,
    which loads the checkpoint, must get the learners' weights and version before it samples;
    later syncs reach every generator through the rebuilt transport.

    With one learner rank, disaggregated: a broadcast, and a sync asked for while the engines
    still sample (as asynchronous rollouts ask for it) waits for them before learner rank 0
    queues its broadcast, which would otherwise wait on the group's timeout (shrunk here to
    3 s) for as long as they sample. With two, colocated and taking turns as GPUs do
    (`placement.emulate_gpus`): each rank hands the engine beside it its tensors, and the
    device-memory ledger checks every transition, a replacement's included."""
    turns = transport == "handles"
    cfg = two_generators(tiny_cfg).replace(**{
        "learner.num_workers": learner_ranks, "learner.lr": 1e-3, "learner.warmup_steps": 0,
        **({"placement.emulate_gpus": True} if turns else {"placement.mode": "disaggregated", "sync.timeout_s": 3.0})})
    assert weight_transport(cfg) == transport and cfg.placement.takes_turns == turns
    runtime = Runtime.start(cfg, tiny_policy)  # it brings a replacement to the current policy
    learners, generators = runtime.learners, runtime.generators
    try:
        prompt_ids = questions(cfg, tiny_policy, 16)
        seeds = cfg.sampling_seeds("deaths", len(prompt_ids))
        if not turns:
            # Three calls queued, each about as long as the timeout on a 2-core EPYC: the
            # engines sample well past it on a machine a few times as fast.
            busy = [generators.generate(prompt_ids * 6, n=32, temperature=1.0, top_p=1.0, max_tokens=48) for _ in range(3)]
            start = time.monotonic()
            assert train_once(runtime, seed=3)["policy_version"] == 1
            waited = time.monotonic() - start
            assert waited > cfg.sync.timeout_s, waited  # it waited for the engines, and no timeout fired
            assert [len(generators.gather(call)) for call in busy] == [16 * 6] * 3
        base = sample(generators, prompt_ids, seeds)
        version = train_once(runtime)["policy_version"]
        trained = sample(generators, prompt_ids, seeds)
        assert trained[8:] != base[8:]  # generator 1's share: the weights moved enough to change its answers

        kill_and_wait(generators.workers[1])  # dead before the call: its share fails at once
        counts = Counter()
        recovered = sample(generators, prompt_ids, seeds, counts)
        assert counts == {"replaced": 1, "retried_prompts": 8}
        assert recovered == trained  # the current version's answers, not the checkpoint's
        assert {r.version for rollouts in recovered for r in rollouts} == {version}
        assert ray.get([w.policy_version.remote() for w in generators.workers]) == [version, version]
        assert runtime.version == version  # the rebuild sent the same weights again: no new version

        assert train_once(runtime, seed=1)["policy_version"] == version + 1  # through the rebuilt group, to both
        assert ray.get([w.policy_version.remote() for w in generators.workers]) == [version + 1] * 2
        again = sample(generators, prompt_ids, seeds)
        assert again[:8] != trained[:8] and again[8:] != trained[8:]  # both engines took the new weights

        # A generator that dies where the sync finds it (its transfer fails): replaced by the
        # runtime, which sends the new version to the replacement and the survivor alike.
        # Colocated, the learners' state leaves the GPU before the new engine starts on it
        # (the ledger refuses a replacement beside it).
        runtime.hand_over_to_learners()
        learners.update(synthetic_batch(seed=2), LossSpec())
        os.kill(ray.get(generators.workers[0].pid.remote()), signal.SIGKILL)
        pushed = runtime.sync_weights()
        runtime.hand_over_to_generators()
        assert (pushed["policy_version"], pushed["sync_generator_replaced"]) == (version + 2, 1)
        assert ray.get([w.policy_version.remote() for w in generators.workers]) == [version + 2] * 2
        third = sample(generators, prompt_ids, seeds)
        assert third[:8] != again[:8] and third[8:] != again[8:]
        assert {r.version for rollouts in third for r in rollouts} == {version + 2}
        if turns:  # every transition, the replacement's too, within the GPUs and the plan
            phases = {o.phase for o in runtime.ledger.observations}
            assert {"learner set-up", "engine start-up", "hand-over", "update", "sync", "replacement"} <= phases
    finally:
        runtime.shutdown()


@pytest.mark.timeout(300)  # a hang fails here instead of at the suite's limit
def test_a_replacement_that_cannot_start_ends_in_a_clear_error(ray_cluster, tiny_cfg, tiny_policy, monkeypatch):
    """The generators' placement group is removed (as when its node is lost for good): both
    generators die with it, and their replacements wait for bundles that never come back. The
    wait is bounded (shrunk here with monkeypatch from its 900 s to 5 s), then an error names the
    generator and why."""
    import rayrep.cluster.supervisor

    monkeypatch.setattr(rayrep.cluster.supervisor, "READY_TIMEOUT_S", 5.0)
    cfg = two_generators(tiny_cfg)
    placement = Placement(make_plan(cfg, learners=False))
    generators = GeneratorGroup.create(cfg, tiny_policy, placement)
    try:
        pending = generators.generate([[5, 6, 7, 8]] * 4, n=2, temperature=1.0, top_p=1.0, max_tokens=8)
        placement.remove()
        start = time.monotonic()
        # The cause reads "ActorDiedError: ..." or "it no longer answers", by when the removal lands.
        with pytest.raises(RuntimeError, match=r"(?s)generator 0 died \(.*\) and its replacement did not "
                                               r"start within 5 s \(is its placement-group bundle gone"):
            generators.complete(pending)
        assert time.monotonic() - start < 60
    finally:
        for worker in generators.workers:
            ray.kill(worker)
