"""One global seed: `run.seed` changes a whole run (that the same seed repeats one is in
tests/test_resume.py); explicit seeds still win."""

import hashlib

import pytest

from conftest import SHORT_RUN
from rayrep.config import derive_seed, load_preset
from rayrep.run.log import read_metrics
from rayrep.train import train

COMPARED = ("accuracy", "reward_mean", "generated_tokens", "grad_norm", "fresh_entropy")


def test_every_seed_derives_from_the_run_seed_unless_set():
    cfg = load_preset("tiny-cpu")
    other = cfg.replace(**{"run.seed": 1})
    assert cfg.seed("data") == derive_seed(0, "data") != other.seed("data")
    assert [cfg.seed("generator", i) for i in range(3)] == [derive_seed(0, "generator", i) for i in range(3)]
    assert len({cfg.seed("generator", 0), cfg.seed("generator", 1), cfg.seed("data")}) == 3
    pinned = cfg.replace(**{"generator.seed": 7, "data.shuffle_seed": 3, "run.seed": 5})
    assert (pinned.seed("generator", 2), pinned.seed("data")) == (9, 3)
    # the formula: blake2b of "run seed/role/index", 31 bits (stable across machines and Pythons)
    assert derive_seed(3, "generator", 2) == int.from_bytes(hashlib.blake2b(b"3/generator/2", digest_size=4).digest(), "big") & 0x7FFFFFFF


def test_another_run_seed_changes_the_run(ray_cluster, tiny_cfg, short_run, tmp_path):
    """That the same `run.seed` repeats a run step for step is tested with more at stake in
    tests/test_resume.py (a run killed and resumed, against the uninterrupted one); here
    another seed must change what the run samples. This run also takes verl's geometric
    rejection and veto (`docs/mismatch.md`) beside the short run's decoupled PPO: fp32 engines
    on CPU leave nothing to reject, and every step records so. And a KL penalty to the
    reference policy: its weights taking turns with the engines beside the policy's, in the
    device-memory ledger's plan (the short run's learners' hand-over held them less)."""
    cfg = tiny_cfg.replace(**SHORT_RUN, **{"run.seed": 1, "logging.out_dir": str(tmp_path), "logging.run_name": "b",
                                           "learner.correction.reject": "geometric",
                                           "learner.correction.reject_upper": 1.001, "learner.correction.veto": 1e-4,
                                           "learner.kl.coef": 0.01})
    records = [r for r in read_metrics(train(cfg, log=lambda _: None).run_dir / "metrics.jsonl") if r["step"] > 0]
    assert all(r["mismatch_masked_tokens"] == r["mismatch_masked_sequences"] == 0 for r in records)
    # From each step's second mini-batch on, the policy has moved away from the reference.
    assert all(r["kl_ref"] > 0 for r in records)
    from rayrep.cluster.memory import GIB, REFERENCE, memory_plan
    reference = memory_plan(cfg).sizes["learner"][REFERENCE]
    assert reference > 0
    for mine, short in zip(records, [r for r in short_run if r["step"] > 0]):
        assert mine["memory_hand_over_learner_gib"] - short["memory_hand_over_learner_gib"] == \
            pytest.approx(reference / GIB, rel=0.01)
    first = [{k: r[k] for k in COMPARED} for r in short_run if r["step"] > 0]
    other = [{k: r[k] for k in COMPARED} for r in records]
    assert len(first) == len(other) == 2
    assert first[0]["accuracy"] != other[0]["accuracy"] or first[0]["generated_tokens"] != other[0]["generated_tokens"]
