"""The mismatch metrics against the formulas written out token by token in plain Python
(verl's `rollout_corr_helper` definitions, on a hand-made batch)."""

import math

import pytest
import torch

from rayrep.learner.mismatch import mismatch_sums

# Three rows of log-probs: learner's, engine's; row 2 is padding after two tokens, row 3 has
# one extreme token (the learner finds it 30 nats less likely than the engine that sampled it).
LEARNER = [[-0.1, -0.5, -2.0, -0.3], [-1.0, -0.2, 0.0, 0.0], [-0.4, -30.1, -0.7, -0.2]]
ENGINE = [[-0.2, -0.4, -2.5, -0.3], [-1.3, -0.1, 0.0, 0.0], [-0.4, -0.1, -0.6, -0.2]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]


def tensors():
    return torch.tensor(LEARNER, dtype=torch.float64), torch.tensor(ENGINE, dtype=torch.float64), \
        torch.tensor(MASK, dtype=torch.float64)


def d(i, t):
    return LEARNER[i][t] - ENGINE[i][t]


def valid(i):
    return [t for t in range(4) if MASK[i][t]]


def clamp(x):
    return max(-20.0, min(20.0, x))


def test_the_mismatch_metrics_are_the_formulas():
    learner, engine, mask = tensors()
    sums = mismatch_sums(learner, engine, mask)
    got = {name: total / count for name, (total, count) in sums.items()}
    tokens = [(i, t) for i in range(3) for t in valid(i)]

    def mean(values):
        return sum(values) / len(values)

    def row_mean(logp, i):
        return mean([logp[i][t] for t in valid(i)])

    expected = {
        "mismatch_kl": mean([-d(i, t) for i, t in tokens]),
        "mismatch_k3_kl": mean([math.exp(d(i, t)) - d(i, t) - 1 for i, t in tokens]),
        "mismatch_learner_ppl": mean([math.exp(-row_mean(LEARNER, i)) for i in range(3)]),
        "mismatch_engine_ppl": mean([math.exp(-row_mean(ENGINE, i)) for i in range(3)]),
        "mismatch_log_ppl_diff": mean([row_mean(ENGINE, i) - row_mean(LEARNER, i) for i in range(3)]),
        "mismatch_ppl_ratio": mean([math.exp(row_mean(ENGINE, i) - row_mean(LEARNER, i)) for i in range(3)]),
        "mismatch_chi2_token": mean([math.exp(clamp(d(i, t))) ** 2 for i, t in tokens]) - 1,
        "mismatch_chi2_seq": mean([math.exp(2 * clamp(sum(d(i, t) for t in valid(i)))) for i in range(3)]) - 1,
    }
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name
    assert sums["mismatch_kl"][1] == len(tokens) and sums["mismatch_chi2_seq"][1] == 3


def test_padding_counts_for_nothing_whatever_it_holds():
    learner, engine, mask = tensors()
    engine[1, 2:] = float("nan")  # row 2's padding
    learner[1, 2:] = float("inf")
    assert mismatch_sums(learner, engine, mask) == mismatch_sums(*tensors())
