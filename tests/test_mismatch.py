"""The mismatch metrics against the formulas written out token by token in plain Python
(verl's `rollout_corr_helper` definitions, on a hand-made batch)."""

import math

import pytest
import torch

from rayrep.learner.loss import mini_batch_totals, policy_loss
from rayrep.learner.mismatch import (correct, correction_sums, importance_weights, kept_by_band, kept_by_veto,
                                     mismatch_sums)
from rayrep.types import LossSpec, MismatchCorrection

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


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [2.0, 1.05])
def test_importance_weights_are_the_truncated_ratios(level, cap):
    learner, engine, mask = tensors()
    got = importance_weights(learner - engine, mask, level, cap)
    for i in range(3):
        for t in range(4):
            if not MASK[i][t]:
                assert got[i, t] == 0
                continue
            exponent = d(i, t) if level == "token" else sum(d(i, u) for u in valid(i))
            assert got[i, t].item() == pytest.approx(min(math.exp(clamp(exponent)), cap), rel=1e-12)
    assert not got.requires_grad


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize(("upper", "lower"), [(2.0, None), (1.2, 0.5)])
def test_rejection_keeps_the_tokens_inside_the_band(level, upper, lower):
    learner, engine, mask = tensors()
    got = kept_by_band(learner - engine, mask, level, upper, lower)
    low = 1 / upper if lower is None else lower
    for i in range(3):
        tokens = valid(i)
        for t in range(4):
            if not MASK[i][t]:
                assert not got[i, t]
                continue
            exponent = {"token": d(i, t), "sequence": sum(d(i, u) for u in tokens),
                        "geometric": sum(d(i, u) for u in tokens) / len(tokens)}[level]
            assert bool(got[i, t]) == (low <= math.exp(clamp(exponent)) <= upper)


def test_the_veto_drops_a_row_with_one_catastrophic_token():
    learner, engine, mask = tensors()
    assert kept_by_veto(learner - engine, mask, 1e-4).tolist() == [True, True, False]
    assert kept_by_veto(learner - engine, mask, 1e-30).tolist() == [True, True, True]
    with pytest.raises(ValueError, match="veto"):
        kept_by_veto(learner - engine, mask, 0.0)


def test_a_correction_keeps_what_band_and_veto_keep_and_weighs_by_the_truncated_ratio():
    learner, engine, mask = tensors()
    correction = MismatchCorrection(weights="token", weight_cap=1.2, reject="token", reject_upper=1.2,
                                    reject_lower=0.5, veto=1e-4)
    corrected = correct(learner, engine, mask, correction)
    # Row 1: token 2 out (ratio e^0.5 > 1.2); row 2: token 0 (e^0.3); row 3: all four (the veto).
    assert corrected.kept.tolist() == [[True, True, False, True], [False, True, False, False], [False] * 4]
    assert torch.equal(corrected.weights, importance_weights(learner - engine, mask, "token", 1.2))
    shares = correction_sums(mask, corrected, correction)
    assert shares["mismatch_masked_tokens"] == (6.0, 10.0) and shares["mismatch_masked_sequences"] == (3.0, 3.0)
    assert shares["mismatch_truncated_tokens"] == (2.0, 10.0)  # the same two tokens, above the cap
    expected_mean = sum(min(math.exp(clamp(d(i, t))), 1.2) for i in range(3) for t in valid(i))
    assert shares["mismatch_weight_mean"] == (pytest.approx(expected_mean, rel=1e-12), 10.0)
    assert correct(learner, engine, mask, MismatchCorrection(reject="sequence")).weights is None


def test_rejected_tokens_leave_the_loss_and_its_counts_and_weights_multiply_the_rest():
    """`policy_loss` with the correction as the learner applies it equals the token-mean of
    weight x PPO loss over the kept tokens, written out; counts per row give the same totals
    as the mask they count."""
    torch.manual_seed(0)
    old, engine, mask = tensors()
    logp = (old + 0.05 * torch.randn_like(old)).requires_grad_()
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    correction = MismatchCorrection(weights="sequence", weight_cap=1.5, reject="token", reject_upper=1.2,
                                    reject_lower=0.5)
    spec = LossSpec(correction=correction, dual_clip=None)
    corrected = correct(old, engine, mask, correction)
    totals = mini_batch_totals(corrected.kept.sum(-1))
    assert totals == mini_batch_totals(corrected.kept)
    loss, _ = policy_loss(logp, old, advantages, corrected.kept, spec, totals=totals,
                          correction_weights=corrected.weights)
    expected, kept = 0.0, 0
    for i in range(3):
        for t in range(4):
            if not corrected.kept[i, t]:
                continue
            ratio = math.exp(logp[i, t].item() - old[i, t].item())
            term = max(-advantages[i].item() * ratio, -advantages[i].item() * min(max(ratio, 0.8), 1.28))
            expected += corrected.weights[i, t].item() * term
            kept += 1
    assert loss.item() == pytest.approx(expected / kept, rel=1e-10)
    with pytest.raises(ValueError, match="set one"):
        LossSpec(behaviour_cap=2.0, correction=correction)
