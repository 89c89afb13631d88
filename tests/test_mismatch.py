"""The mismatch metrics against the formulas written out token by token in plain Python
(verl's `rollout_corr_helper` definitions, on a hand-made batch)."""

import math

import pytest
import torch

from rayrep.learner.loss import mini_batch_totals, policy_loss
from rayrep.learner.mismatch import (correct, correction_sums, importance_weights, kept_by_rejection, kept_by_veto,
                                     mismatch_sums)
from rayrep.types import LossSpec, MismatchCorrection, parse_rejections

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


def verl_rejection_mask(log_ratio, response_mask, option, lower, upper):
    """verl 0.9's `compute_rollout_rejection_mask` for one option, transcribed token by token:
    the log ratio clamped per token to +-20, the option's divergence, the token's own or the
    answer's sum / mean / largest, kept within log(lower)..log(upper) (k1) or up to upper."""
    aggregate, divergence = option.rsplit("_", 1)
    keep = []
    for i, row in enumerate(log_ratio.tolist()):
        tokens = [t for t in range(len(row)) if response_mask[i][t]]
        values = {}
        for t in tokens:
            x = clamp(row[t])
            values[t] = {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1.0 - x}[divergence]
        if aggregate == "token":
            stats = values
        else:
            if not tokens:
                row_stat = 0.0
            elif aggregate == "seq_sum":
                row_stat = sum(values.values())
            elif aggregate == "seq_mean":
                row_stat = sum(values.values()) / len(tokens)
            else:
                row_stat = max(values.values())
            stats = {t: row_stat for t in tokens}
        kept_row = []
        for t in range(len(row)):
            if t not in stats:
                kept_row.append(False)
            elif divergence == "k1":
                kept_row.append(math.log(lower) <= stats[t] <= math.log(upper))
            else:
                kept_row.append(stats[t] <= upper)
        keep.append(kept_row)
    return keep


# Each option with thresholds that keep some tokens and drop others on `tensors()`.
OPTIONS = [("token_k1", "0.9_1.2"), ("token_k1", "1.5"), ("seq_sum_k1", "0.5_2.0"), ("seq_mean_k1", "0.9_1.1"),
           ("token_k2", "0.01"), ("token_k3", "0.02"), ("seq_sum_k2", "0.1"), ("seq_sum_k3", "0.1"),
           ("seq_mean_k2", "0.03"), ("seq_mean_k3", "0.03"), ("seq_max_k2", "0.05"), ("seq_max_k3", "0.05")]


@pytest.mark.parametrize(("option", "threshold"), OPTIONS)
def test_each_rejection_option_keeps_what_verls_keeps(option, threshold):
    learner, engine, mask = tensors()
    (rule,) = parse_rejections(option, threshold)
    got = kept_by_rejection(learner - engine, mask, rule)
    expected = verl_rejection_mask(learner - engine, MASK, option, rule.lower, rule.upper)
    assert got.tolist() == expected
    assert 0 < got.sum() < mask.sum()  # the thresholds draw a line through the batch


def test_a_k1_threshold_bounds_the_inverse_ratio_and_rayreps_band_is_it_inverted():
    """verl's k1 options keep log(lower) <= -log r <= log(upper): the band [lower, upper] is on
    pi_engine / pi_learner. rayrep's `reject` band is on r itself: its [l, u] is verl's
    "1/u_1/l", and one threshold u (verl's lower 1/u) is the same band either way."""
    learner, engine, mask = tensors()
    log_ratio = learner - engine
    for own, option in (("token", "token_k1"), ("sequence", "seq_sum_k1"), ("geometric", "seq_mean_k1")):
        mine = correct(learner, engine, mask, MismatchCorrection(reject=own, reject_upper=1.25, reject_lower=0.8)).kept
        (verls,) = parse_rejections(option, f"{1 / 1.25}_{1 / 0.8}")
        assert torch.equal(mine, kept_by_rejection(log_ratio, mask, verls)), own
    # The direction decides row 0's third token, r = e^0.5 = 1.65: 1/r = 0.61 lies in verl's
    # "0.6_1.2", r outside rayrep's [0.6, 1.2].
    (rule,) = parse_rejections("token_k1", "0.6_1.2")
    kept = kept_by_rejection(log_ratio, mask, rule)
    assert kept[0, 2] and not correct(learner, engine, mask, MismatchCorrection(
        reject="token", reject_upper=1.2, reject_lower=0.6)).kept[0, 2]


def test_rejection_rules_and_the_band_all_must_keep_a_token():
    learner, engine, mask = tensors()
    rules = parse_rejections("token_k1,seq_max_k2", "0.9_1.2,0.05")
    correction = MismatchCorrection(reject="geometric", reject_upper=1.05, rs=rules)
    expected = kept_by_rejection(learner - engine, mask, rules[0]) & kept_by_rejection(learner - engine, mask, rules[1])
    expected &= kept_by_rejection(learner - engine, mask, correction.rejections[0])
    assert torch.equal(correct(learner, engine, mask, correction).kept, expected)
    assert correction.rejects and len(correction.rejections) == 3


@pytest.mark.parametrize(("options", "thresholds", "message"), [
    ("seq_max_k1", "2", "unknown rejection option 'seq_max_k1'"),
    ("token_k1,token_k2", "1.5,0.1,0.2", "need one threshold or one each"),
    ("token_k2", "0.1_0.2", "one number"),
    ("token_k1", "2_0.5", "lower end is above its upper end"),
    ("token_k1", "-2", "positive and finite"),
    ("seq_sum_k3", "", "need one threshold or one each"),
    ("", "2.0", "without a rejection option"),
])
def test_verls_thresholds_parse_as_verl_parses_them_or_fail_naming_them(options, thresholds, message):
    with pytest.raises(ValueError, match=message):
        parse_rejections(options, thresholds)


def test_icepops_weights_are_zero_outside_their_band():
    learner, engine, mask = tensors()
    weights = importance_weights(learner - engine, mask, "token", 1.2, lower=0.9)
    for i in range(3):
        for t in range(4):
            ratio = math.exp(clamp(d(i, t)))
            expected = ratio if MASK[i][t] and 0.9 <= ratio <= 1.2 else 0.0
            assert weights[i, t].item() == pytest.approx(expected, rel=1e-12)
    correction = MismatchCorrection(weights="token", weight_cap=1.2, weight_lower=0.9)
    shares = correction_sums(mask, correct(learner, engine, mask, correction), correction)
    out = sum(1 for i in range(3) for t in valid(i) if not 0.9 <= math.exp(clamp(d(i, t))) <= 1.2)
    assert shares["mismatch_truncated_tokens"] == (float(out), 10.0) and out > 0


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


def test_the_config_takes_verls_options_as_verl_writes_them_or_names_what_is_wrong():
    from rayrep.config import ConfigError, parse_cli

    def correction(*args):
        return parse_cli(list(args)).learner.loss_spec().correction

    geo = correction("--learner.correction.rollout_rs", "seq_mean_k1", "--learner.correction.rollout_rs_threshold",
                     "0.999_1.001")
    assert geo.rejections == parse_rejections("seq_mean_k1", "0.999_1.001") and geo.rejects
    assert correction() is None
    with pytest.raises(ConfigError, match="learner.correction.rollout_rs='seq_max_k1'"):
        correction("--learner.correction.rollout_rs", "seq_max_k1", "--learner.correction.rollout_rs_threshold", "2")
    with pytest.raises(ConfigError, match="weight_lower=0.5 bounds importance weights"):
        correction("--learner.correction.weight_lower", "0.5")
