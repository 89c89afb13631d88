"""Asynchronous rollouts (`run.max_policy_lag`): the next step's round samples while the
learners update, on a real local Ray cluster; its answers are one version old, never more,
and the decoupled-PPO weights correct them."""

import pytest

from conftest import SHORT_RUN
from test_learner_and_sync import synthetic_batch
from rayrep.config import ConfigError
from rayrep.rollouts import drop_stale, policy_lag_stats, rounds_ahead
from rayrep.run.log import read_metrics
from rayrep.train import train
from rayrep.types import Answer, Group, LossSpec, Prompt, Rollout

CLOCK = ("time", "tokens_per_second", "sync_seconds", "sync_gbps")


def group(uid: str, versions: list[int], replayed: list[bool] | None = None) -> Group:
    rollouts = tuple(Rollout([1], [2], [-0.5], "text", "stop", version=v) for v in versions)
    replayed = replayed or [False] * len(versions)
    return Group(Prompt(uid, ({"role": "user", "content": "q"},), "1"),
                 tuple(Answer.of(r, correct=True, replayed=again) for r, again in zip(rollouts, replayed)))


def test_rounds_ahead_stop_at_the_run_end_and_at_checkpoints(tiny_cfg):
    cfg = tiny_cfg.replace(**{"run.max_policy_lag": 2, "run.steps": 10, "run.save_every": 4})
    assert [rounds_ahead(cfg, step) for step in range(1, 11)] == [2, 2, 1, 0, 2, 2, 1, 0, 1, 0]
    assert all(rounds_ahead(tiny_cfg.replace(**{"run.steps": 10}), step) == 0 for step in range(1, 11))


def test_groups_with_answers_beyond_the_lag_are_dropped_and_counted():
    groups = [group("a", [5, 5]), group("b", [4, 5]), group("c", [3, 5]), group("d", [5, 1], replayed=[False, True])]
    kept, stale = drop_stale(groups, version=5, max_lag=1)
    assert [g.prompt.uid for g in kept] == ["a", "b", "d"]  # a replayed answer's age is replay's business
    assert stale == {"stale_groups_dropped": 1}
    assert drop_stale(groups, version=5, max_lag=2) == (groups, {})
    stats = policy_lag_stats(kept, version=5)
    assert stats == {"fresh_lag_0": 4, "fresh_lag_1": 1, "fresh_lag_mean": 0.2, "fresh_lag_max": 1,
                     "replay_lag_mean": 4.0}


def test_colocated_gpus_cannot_sample_ahead(tiny_cfg):
    with pytest.raises(ConfigError, match="max_policy_lag=1 needs generators that keep their GPUs"):
        tiny_cfg.replace(**{"run.max_policy_lag": 1, "placement.device": "gpu", "placement.mode": "colocated"})
    with pytest.raises(ConfigError, match="max_policy_lag=1 needs generators that keep their GPUs"):
        tiny_cfg.replace(**{"run.max_policy_lag": 1, "placement.emulate_gpus": True})  # nor emulated ones


def test_lent_cores_need_pinned_cpu_roles_that_sample_ahead(tiny_cfg):
    pinned = {"placement.mode": "disaggregated", "placement.pin_cores": True, "placement.threads": 1}
    tiny_cfg.replace(**pinned, **{"run.max_policy_lag": 1, "placement.lend_idle_cores": True})
    for missing, named in (({"run.max_policy_lag": 0}, "run.max_policy_lag > 0"),
                           ({"placement.pin_cores": False}, "placement.pin_cores=true"),
                           ({"learner.num_workers": 2}, "learner.num_workers=1"),
                           ({"placement.device": "gpu", "placement.pin_cores": False},
                            "placement.device='cpu', placement.pin_cores=true")):
        with pytest.raises(ConfigError, match=rf"lend_idle_cores .* the one learner rank: it needs {named}$"):
            tiny_cfg.replace(**{**pinned, "run.max_policy_lag": 1, "placement.lend_idle_cores": True, **missing})


def test_a_core_loan_binds_every_thread_and_gives_each_its_own_back(ray_cluster):
    """`CoreLoan` in this process: the lent core (an offer of another node lends nothing) for
    the calling thread, a thread started before the loan and torch's thread count; after
    it, each thread's cores as before."""
    import os
    import threading

    import ray
    import torch

    from rayrep.cluster.cores import CoreLoan, bind_threads, thread_cores

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to lend")
    own, other = cores[-1], cores[0]
    before, threads = thread_cores(), torch.get_num_threads()
    node = ray.get_runtime_context().get_node_id()
    idle = threading.Event()
    try:
        os.sched_setaffinity(0, {own})
        torch.set_num_threads(1)
        started = threading.Thread(target=idle.wait)  # bound to `own`, as the calling thread is
        started.start()
        with CoreLoan([ray.put((node, [other])), ray.put(("another node", [own, other, 7]))]) as loan:
            loan.take()
            assert os.sched_getaffinity(0) == {own, other} and torch.get_num_threads() == 2
            assert os.sched_getaffinity(started.native_id) == {own, other}
            loan.take()
        assert loan.borrowed_share() == 1.0
        assert os.sched_getaffinity(0) == {own} and torch.get_num_threads() == 1
        assert os.sched_getaffinity(started.native_id) == {own}
    finally:
        idle.set()
        bind_threads(before, set(cores))
        torch.set_num_threads(threads)


def comparable(record: dict) -> dict:
    """What two runs that took the same steps share (their GPUs' memory aside: the short run is
    colocated, this one disaggregated)."""
    return {k: v for k, v in record.items()
            if not k.startswith(("time_", "fresh_lag_", "memory_")) and k not in CLOCK}


@pytest.mark.timeout(900)
def test_one_step_ahead_trains_on_answers_one_version_old(ray_cluster, tiny_cfg, short_run, tmp_path):
    """As a GPU run samples ahead: disaggregated, the residency checks and the ledger of the
    learners' and the engine's GPUs live (`placement.emulate_gpus`, from the short run)."""
    cfg = tiny_cfg.replace(**SHORT_RUN, **{"run.max_policy_lag": 1, "logging.out_dir": str(tmp_path),
                                           "logging.run_name": "lag-1", "placement.mode": "disaggregated",
                                           "generator.num_workers": 1})
    runs = {0: short_run, 1: read_metrics(train(cfg, log=lambda _: None).run_dir / "metrics.jsonl")}
    sync, ahead = runs[0][1:], runs[1][1:]
    answers = 16 * 8
    # Synchronous: every answer comes from the policy the update starts from.
    assert [(r["fresh_lag_0"], r["fresh_lag_max"]) for r in sync] == [(answers, 0)] * 2
    # One step ahead: step 1's round has nothing before it to overlap (the same step as the
    # synchronous run's: same seeds, same weights); step 2's was sampled during step 1's
    # update, one version old.
    assert comparable(ahead[0]) == comparable(sync[0])
    assert [(r.get("fresh_lag_1"), r["fresh_lag_max"]) for r in ahead[1:]] == [(answers, 1)]
    assert all("fresh_lag_0" not in r and "stale_groups_dropped" not in r for r in ahead[1:])
    # Their loss is corrected: pi_prox / pi_behaviour is 1 up to the engines' rounding when
    # the answers are on-policy, and moves off it when the sampling policy is a version behind.
    assert all(r["behaviour_weight_max"] < 1.05 for r in sync)
    assert all(r["behaviour_weight_max"] > s["behaviour_weight_max"] for r, s in zip(ahead[1:], sync[1:]))
    assert ahead[1]["policy_version"] == sync[1]["policy_version"] == 2
    # The ledger saw each role's GPUs: the engine's awake while the learner updated and synced.
    assert all(r["memory_update_gib"] > 68 and r["memory_sync_gib"] > 68 for r in ahead)


def test_pinned_cores_keep_generators_and_learners_apart(ray_cluster, tiny_cfg, tiny_policy):
    """`placement.pin_cores`: generator 0 on its cores, learner 0 on the next ones (wrapping
    around the machine's cores), as the processes themselves report; with
    `placement.lend_idle_cores` the learner's update also runs on an idle generator's cores,
    and on its own again after."""
    import os
    import time

    import ray

    from rayrep.cluster.placement import Placement, make_plan, pinned_cores
    from rayrep.generator.group import GeneratorGroup
    from rayrep.learner.group import LearnerGroup

    cfg = tiny_cfg.replace(**{"placement.mode": "disaggregated", "placement.pin_cores": True, "placement.threads": 1,
                              "placement.cpus_per_bundle": 1, "verifier.num_workers": 0})
    cores = os.cpu_count()
    assert pinned_cores(cfg, "generator", 0, 1) == [0] and pinned_cores(cfg, "learner", 0, 1) == [1 % cores]
    assert pinned_cores(cfg, "learner", 1, 2) == sorted({2 % cores, 3 % cores})
    assert pinned_cores(tiny_cfg, "learner", 0, 1) is None  # not asked: no binding

    placement = Placement(make_plan(cfg))
    learners = LearnerGroup(cfg, tiny_policy, placement)
    generators = GeneratorGroup.create(cfg, tiny_policy, placement)
    try:
        def affinity(actor, *_):
            return sorted(os.sched_getaffinity(0))

        assert ray.get(learners.workers[0].__ray_call__.remote(affinity)) == [1 % cores]
        assert ray.get(generators.workers[0].__ray_call__.remote(affinity)) == [0]
        (rollouts,) = generators.gather(generators.generate([[5, 6, 7, 8]], n=2, temperature=1.0, top_p=1.0,
                                                            max_tokens=8))
        assert len(rollouts) == 2  # the bound engine samples

        # `placement.lend_idle_cores`: an idle engine's offer lets the update run on its core
        # too; a busy one's offer resolves only after the round, so the update keeps its own.
        def cores_and_threads(actor, *_):
            import torch
            return sorted(os.sched_getaffinity(0)), torch.get_num_threads()

        batch = synthetic_batch()
        offers = generators.offer_cores()
        ray.wait(offers, num_returns=len(offers))
        assert ray.get(offers) == [(ray.get_runtime_context().get_node_id(), [0])]
        lent = learners.update(batch, LossSpec(), core_offers=offers)
        # (whether the first pass already sees the offer resolved is Ray's business; one core: nothing to lend)
        assert lent["update_on_lent_cores"] > 0.0 if cores > 1 else lent["update_on_lent_cores"] == 0.0
        generators.workers[0].__ray_call__.remote(lambda actor: time.sleep(30))  # an engine at work
        offers = generators.offer_cores()
        kept = learners.update(batch, LossSpec(), core_offers=offers)
        assert not ray.wait(offers, timeout=0)[0]  # (still at work after the update)
        assert kept["update_on_lent_cores"] == 0.0
        assert "update_on_lent_cores" not in learners.update(batch, LossSpec())

        def fails(actor, *_):
            raise RuntimeError("an engine that failed before it could offer")

        failed = [learners.workers[0].__ray_call__.remote(fails)]  # (as a dead generator's offer resolves)
        assert learners.update(batch, LossSpec(), core_offers=failed)["update_on_lent_cores"] == 0.0
        assert ray.get(learners.workers[0].__ray_call__.remote(cores_and_threads)) == ([1 % cores], 1)
    finally:
        learners.shutdown()
        for worker in generators.workers:
            ray.kill(worker)
        placement.remove()
