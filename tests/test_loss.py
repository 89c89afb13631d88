"""policy_loss: clip boundaries, dual clip, replay shaping, aggregation, entropy bonus, micro-batching."""

from __future__ import annotations

import math

import pytest
import torch

from rayrep.learner.loss import Totals, mini_batch_totals, policy_loss
from rayrep.learner.sums import MetricSums
from rayrep.types import AGGREGATIONS, TOKEN_SUM_AGGREGATIONS, LossSpec

DEFAULT = LossSpec()


def one_token(ratio: float, advantage: float, *, replayed: bool = False, **spec):
    """Loss, d loss / d logp and metrics for a batch of one valid token with ratio `ratio`."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old_logp = torch.zeros(1, 1, dtype=torch.float64)
    loss, metrics = policy_loss(
        logp,
        old_logp,
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        LossSpec(**spec),
        replay_mask=torch.tensor([replayed]),
    )
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


# ---- PPO clip with clip-higher (0.2 / 0.28) and dual clip c = 10 ------------------------

# (ratio, advantage, expected loss, expected gradient, clipped, dual-clipped)
# d(-A r)/d logp = -A r where the unclipped branch is active, 0 where a bound is.
CLIP_CASES = [
    (1.27, 1.0, -1.27, -1.27, 0, 0),  # just inside the upper bound 1.28
    (1.29, 1.0, -1.28, 0.0, 1, 0),  # just outside: clipped, no gradient
    (0.81, 1.0, -0.81, -0.81, 0, 0),
    (0.79, 1.0, -0.79, -0.79, 0, 0),  # A > 0 is never clipped from below (pessimism)
    (0.81, -1.0, 0.81, 0.81, 0, 0),  # just inside the lower bound 0.8
    (0.79, -1.0, 0.80, 0.0, 1, 0),  # just outside: clipped
    (1.29, -1.0, 1.29, 1.29, 0, 0),  # A < 0 is never clipped from above ...
    (9.9, -2.0, 19.8, 19.8, 0, 0),  # ... until the dual clip at c = 10
    (10.1, -2.0, 20.0, 0.0, 0, 1),
    (30.0, 1.0, -1.28, 0.0, 1, 0),  # the dual clip is for A < 0 only
]


@pytest.mark.parametrize(("ratio", "advantage", "loss", "grad", "clipped", "dual"), CLIP_CASES)
def test_clip_boundaries_value_and_gradient(ratio, advantage, loss, grad, clipped, dual):
    value, gradient, metrics = one_token(ratio, advantage)
    assert value == pytest.approx(loss, abs=1e-12)
    assert gradient == pytest.approx(grad, abs=1e-12)
    assert metrics["fresh_clip_frac"] == clipped
    assert metrics["dual_clip_frac"] == dual


def test_dual_clip_none_disables_it():
    value, gradient, metrics = one_token(10.1, -2.0, dual_clip=None)
    assert value == pytest.approx(20.2)
    assert gradient == pytest.approx(20.2)
    assert metrics["dual_clip_frac"] == 0


def test_tie_at_the_clip_boundary_keeps_the_unclipped_gradient():
    # With a zero-width range, ratio 1 sits exactly on both bounds: clipped and unclipped
    # losses tie, and the token must keep its full gradient -A r (not half of it).
    value, gradient, metrics = one_token(1.0, 2.0, clip_low=0.0, clip_high=0.0)
    assert (value, gradient) == (-2.0, -2.0)
    assert metrics["fresh_clip_frac"] == 0


def test_custom_clip_range():
    value, gradient, _ = one_token(1.15, 1.0, clip_low=0.1, clip_high=0.1)
    assert (value, gradient) == (pytest.approx(-1.1), 0.0)


@pytest.mark.parametrize(
    ("ratio", "advantage"), [(1.5, 1.0), (0.5, -1.0), (20.0, -1.0), (0.1, 1.0)]
)
def test_unclipped_fresh_tokens_are_plain_importance_weighting(ratio, advantage):
    value, gradient, metrics = one_token(ratio, advantage, clip_fresh=False)
    assert value == pytest.approx(-advantage * ratio)
    assert gradient == pytest.approx(-advantage * ratio)
    assert metrics["fresh_clip_frac"] == 0 and metrics["dual_clip_frac"] == 0


# ---- ExGRPO replay shaping f(w) = w / (w + beta) ----------------------------------------


@pytest.mark.parametrize("w", [1e-4, 0.1, 1.0, 1000.0])
@pytest.mark.parametrize("advantage", [1.0, -0.5])
def test_replay_shaping_value_and_gradient(w, advantage):
    beta = 0.1
    value, gradient, metrics = one_token(
        w, advantage, replayed=True, replay_loss="shaped", replay_beta=beta
    )
    assert value == pytest.approx(-advantage * w / (w + beta), rel=1e-9)
    # d f(w) / d logp = f'(w) * w = beta * w / (w + beta)^2
    assert gradient == pytest.approx(-advantage * beta * w / (w + beta) ** 2, rel=1e-9)
    assert metrics["replay_clip_frac"] == 0 and metrics["dual_clip_frac"] == 0
    assert metrics["replay_tokens"] == 1 and metrics["fresh_tokens"] == 0


def test_replay_shaping_limits():
    # w -> 0: f(w) ~ w / beta, the gradient of a nearly impossible success is ~ w / beta.
    value, gradient, _ = one_token(1e-6, 1.0, replayed=True, replay_loss="shaped")
    assert value == pytest.approx(-1e-5, rel=1e-4)
    assert gradient == pytest.approx(-1e-5, rel=1e-4)
    # w >> 1: f -> 1 and the gradient vanishes like beta / w, where PPO would clip.
    value, gradient, _ = one_token(1e4, 1.0, replayed=True, replay_loss="shaped")
    assert value == pytest.approx(-1.0, abs=1e-4)
    assert gradient == pytest.approx(-1e-5, rel=1e-3)


def test_replayed_tokens_without_shaping_follow_ppo():
    value, gradient, metrics = one_token(1.5, 1.0, replayed=True)
    assert (value, gradient) == (pytest.approx(-1.28), 0.0)
    assert metrics["replay_clip_frac"] == 1 and metrics["fresh_tokens"] == 0
    value, gradient, metrics = one_token(12.0, -1.0, replayed=True)
    assert (value, gradient) == (pytest.approx(10.0), 0.0)
    assert metrics["dual_clip_frac"] == 1 and metrics["replay_clip_frac"] == 0


def test_clip_fresh_applies_to_fresh_tokens_only():
    # Fresh tokens unclipped; replayed tokens under PPO keep their clip.
    value, gradient, metrics = one_token(1.5, 1.0, clip_fresh=False)
    assert (value, gradient) == (pytest.approx(-1.5), pytest.approx(-1.5))
    value, gradient, metrics = one_token(1.5, 1.0, replayed=True, clip_fresh=False)
    assert (value, gradient) == (pytest.approx(-1.28), 0.0)
    assert metrics["replay_clip_frac"] == 1


def test_fresh_and_replayed_rows_in_one_batch():
    # Row 0 fresh with ratio 1.5 (clipped), row 1 replayed with ratio 1.5 (shaped).
    logp = torch.full((2, 2), math.log(1.5), dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        logp,
        torch.zeros(2, 2, dtype=torch.float64),
        torch.tensor([1.0, 1.0], dtype=torch.float64),
        torch.tensor([[1, 1], [1, 0]]),
        LossSpec(replay_loss="shaped"),
        replay_mask=torch.tensor([False, True]),
    )
    loss.backward()
    shaped = 1.5 / 1.6
    assert loss.item() == pytest.approx((-1.28 * 2 - shaped) / 3)
    expected_grad = torch.tensor([[0.0, 0.0], [-0.1 * 1.5 / 1.6**2 / 3, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected_grad)
    assert metrics["fresh_tokens"] == 2 and metrics["replay_tokens"] == 1
    assert metrics["fresh_clip_frac"] == 1 and metrics["replay_clip_frac"] == 0


# ---- aggregation --------------------------------------------------------------------------

# Ratio 1 and clip_fresh=False make the token loss -A_t, so each mode's value is plain arithmetic.
AGG_ADVANTAGES = torch.tensor(
    [[3.0, 9.0, 9.0], [1.0, 2.0, 3.0], [5.0, 5.0, 5.0]], dtype=torch.float64
)
AGG_MASK = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)  # lengths 1, 3, 0
AGG_CASES = {
    # (3 + 1 + 2 + 3) / 4 tokens
    "token-mean": (-9 / 4, [[-3 / 4, 0, 0], [-1 / 4, -2 / 4, -3 / 4], [0, 0, 0]], {}),
    # (3 / 1 + 6 / 3) / 2 non-empty sequences
    "seq-mean-token-mean": (-5 / 2, [[-3 / 2, 0, 0], [-1 / 6, -2 / 6, -3 / 6], [0, 0, 0]], {}),
    # (3 / 10 + 6 / 10) / 2 non-empty sequences
    "seq-mean-token-sum": (
        -0.45,
        [[-0.15, 0, 0], [-0.05, -0.1, -0.15], [0, 0, 0]],
        {"norm_constant": 10.0},
    ),
    # one call = one micro-batch: (3 + 6) / 10 over 1 micro-batch
    "seq-mean-token-sum-norm": (
        -0.9,
        [[-0.3, 0, 0], [-0.1, -0.2, -0.3], [0, 0, 0]],
        {"norm_constant": 10.0},
    ),
}


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aggregation_modes(agg):
    expected_loss, expected_grad, extra = AGG_CASES[agg]
    logp = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        logp,
        torch.zeros(3, 3, dtype=torch.float64),
        AGG_ADVANTAGES,
        AGG_MASK,
        LossSpec(agg=agg, clip_fresh=False, **extra),
    )
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss)
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=torch.float64))


def test_the_exgrpo_code_scale_is_the_token_sum_over_8192_and_the_accumulation_count():
    """By hand: 4 sequences, micro-batches of 2, ratio 1 and no clip, so token losses are -A.
    The ExGRPO code (verl) divides each micro-batch's token sum by 8192 and then by the 2
    micro-batches it accumulates: L = -(2 x 5 + 1 x 3 + 3 x 1 + 4 x 4) / 8192 / 2."""
    lengths, advantages = [5, 3, 1, 4], [2.0, 1.0, 3.0, 4.0]
    mask = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    spec = LossSpec(agg="seq-mean-token-sum-norm", norm_constant=8192.0, clip_fresh=False)
    totals = mini_batch_totals(mask, spec.agg, micro_batch_size=2)
    logp = torch.zeros(4, 5, dtype=torch.float64, requires_grad=True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        loss, _ = policy_loss(logp[rows], torch.zeros(2, 5, dtype=torch.float64), torch.tensor(advantages[rows],
                              dtype=torch.float64), mask[rows], spec, totals=totals)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(-(2 * 5 + 1 * 3 + 3 * 1 + 4 * 4) / 8192 / 2)
    # each token's gradient is -A / 8192 / 2, whatever its sequence's length
    assert logp.grad[0, 0].item() == pytest.approx(-2.0 / 8192 / 2) and logp.grad[3, 3].item() == pytest.approx(-4.0 / 16384)
    # The Dr.GRPO mean over sequences of the same batch is smaller by the micro-batch size.
    dr_grpo, _ = policy_loss(torch.zeros(4, 5), torch.zeros(4, 5), torch.tensor(advantages), mask,
                             LossSpec(agg="seq-mean-token-sum", norm_constant=8192.0, clip_fresh=False))
    assert total == pytest.approx(2 * dr_grpo.item())
    with pytest.raises(ValueError, match="needs micro_batch_size"):
        mini_batch_totals(mask, spec.agg)


def test_the_exgrpo_preset_gives_the_public_runs_gradient_for_the_same_batch():
    """The public run (ExGRPO/exp_scripts/run_exgrpo.sh; mix_src/mix_actor.py update_policy,
    mix_src/mix_core_alg.py): on each of its W GPUs, every dynamic micro-batch's loss is
    (token losses x mask).sum() / 8192 (the padded response width) / GA, with GA = ppo
    mini-batch // micro-batch per GPU = 64 // 64 = 1; the micro-batch count does not enter;
    FSDP averages the W ranks' gradients. Here, scaled down (W = 2 GPUs of 4 sequences, one
    split into micro-batches of 3 and 1 rows), that is computed by hand beside rayrep's loss
    with micro_batch_size = the public run's sequences per GPU, split its own way: the
    gradients agree token for token. The preset holds the public run's numbers: 512
    sequences per mini-batch over 64 per unit gives its 8 GPUs x GA 1."""
    from rayrep.config import load_preset

    torch.manual_seed(0)
    width, ranks, per_gpu = 7, 2, 4
    mask = torch.rand(ranks * per_gpu, width) < 0.7
    mask[:, 0] = True
    advantages = torch.randn(ranks * per_gpu, dtype=torch.float64)
    old = torch.randn(ranks * per_gpu, width, dtype=torch.float64) * 0.1
    start = old + torch.randn_like(old) * 0.05

    public = start.clone().requires_grad_(True)
    rank_grads = []
    for rank, micro_batches in ((0, [range(0, 3), range(3, 4)]), (1, [range(4, 8)])):
        public.grad = None
        for rows in micro_batches:
            rows = list(rows)
            ratio = (public[rows] - old[rows]).exp()  # unclipped fresh tokens (loss_remove_clip)
            token_loss = -advantages[rows, None] * ratio
            pg_loss = (token_loss * mask[rows]).sum() / width  # / eos_mask.shape[-1]
            (pg_loss / 1).backward()  # / gradient_accumulation
        rank_grads.append(public.grad.clone())
    public_grad = sum(rank_grads) / ranks  # FSDP's gradient average over the ranks

    spec = LossSpec(agg="seq-mean-token-sum-norm", norm_constant=float(width), clip_fresh=False, dual_clip=None)
    totals = mini_batch_totals(mask, spec.agg, micro_batch_size=per_gpu)
    ours = start.clone().requires_grad_(True)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 8)):  # any split: each divides by the whole batch's units
        loss, _ = policy_loss(ours[rows], old[rows], advantages[rows], mask[rows], spec, totals=totals)
        loss.backward()  # the learner sums micro-batches and ranks exactly (backward x world size, FSDP's mean)
    torch.testing.assert_close(ours.grad, public_grad)

    cfg = load_preset("qwen2.5-math-7b-exgrpo")
    sequences = cfg.learner.mini_batch_prompts * cfg.algorithm.group_size
    public_gpus, public_accumulation = 8, 64 // 64
    assert math.ceil(sequences / cfg.learner.micro_batch_size) == public_gpus * public_accumulation
    assert (cfg.learner.loss_agg, cfg.learner.loss_norm_constant) == ("seq-mean-token-sum-norm", 8192.0)
    assert cfg.learner.loss_norm_constant == cfg.generator.max_response_tokens  # the public padded width


def test_aggregation_errors_fail_when_the_spec_is_built():
    with pytest.raises(ValueError, match="'seq-mean'"):
        LossSpec(agg="seq-mean")
    with pytest.raises(ValueError, match="norm_constant=None is required"):
        LossSpec(agg="seq-mean-token-sum")
    with pytest.raises(ValueError, match="norm_constant=8192 only applies"):
        LossSpec(norm_constant=8192)
    with pytest.raises(ValueError, match="norm_constant=None is required"):
        LossSpec(agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="norm_constant"):
        LossSpec(agg="seq-mean-token-sum", norm_constant=0)


# ---- empty masks and garbage in padding ---------------------------------------------------


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_all_zero_mask_gives_zero_loss_with_a_graph(agg):
    extra = {"norm_constant": 8192} if agg in TOKEN_SUM_AGGREGATIONS else {}
    logp = torch.full((2, 3), -math.inf, requires_grad=True)  # padding may hold anything
    loss, metrics = policy_loss(
        logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), LossSpec(agg=agg, **extra)
    )
    assert loss.item() == 0.0
    assert loss.grad_fn is not None
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics["fresh_tokens"] == 0 and "fresh_ratio_mean" not in metrics


def test_padding_values_never_leak_into_loss_or_gradient():
    logp = torch.tensor([[-0.5, -math.inf, math.nan], [-0.1, -0.2, math.inf]], requires_grad=True)
    old_logp = torch.tensor([[-0.5, -math.inf, 0.0], [-0.1, -0.2, 0.0]])
    advantages = torch.tensor([[1.0, math.nan, math.nan], [-1.0, -1.0, math.nan]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, DEFAULT)
    loss.backward()
    # ratio 1 everywhere valid: loss = (-1 + 1 + 1) / 3
    assert loss.item() == pytest.approx(1 / 3)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 3, 0, 0], [1 / 3, 1 / 3, 0]]))
    assert all(math.isfinite(value) for value in metrics.values())


def test_extreme_log_ratio_stays_finite():
    logp = torch.tensor([[200.0, -200.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0]])
    loss, metrics = policy_loss(logp, torch.zeros(1, 2), advantages, torch.ones(1, 2), LossSpec(clip_fresh=False))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(value) for value in metrics.values())


def test_bfloat16_inputs_are_computed_in_float32():
    logp = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), torch.ones(1), torch.ones(1, 2), DEFAULT)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16


# ---- micro-batches and the mini-batch totals --------------------------------------------


def _mixed_batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 4, 2])  # halves hold 7 and 6 tokens
    mask = torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)
    old_logp = -torch.rand(4, 6, generator=generator, dtype=torch.float64) * 3
    # Log-ratios chosen to put tokens on both sides of both clip bounds, and one
    # negative-advantage token (row 2, ratio e^2.5 > 10) under the dual clip.
    log_ratio = torch.tensor(
        [
            [0.4, -0.4, 0.1, 0.2, -0.1, 0.3],
            [0.3, 0.0, 0.0, 0.0, 0.0, 0.0],
            [-0.4, 0.1, 2.5, -0.1, 0.0, 0.0],
            [0.4, -0.5, 0.0, 0.0, 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    logp = old_logp + log_ratio
    advantages = torch.tensor([1.3, -0.7, -2.0, 0.4], dtype=torch.float64)
    replay_mask = torch.tensor([False, True, False, True])
    return logp, old_logp, advantages, mask, replay_mask


def _entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """A per-token "entropy" that depends on logp, so that the bonus has a gradient to check."""
    return (logp - 1.0) ** 2


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("replay_loss", ["ppo", "shaped"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_micro_batches_with_mini_batch_totals_match_full_batch(agg, replay_loss, entropy_coef):
    extra = {"norm_constant": 6.0} if agg in TOKEN_SUM_AGGREGATIONS else {}
    logp, old_logp, advantages, mask, replay_mask = _mixed_batch()
    spec = LossSpec(agg=agg, replay_loss=replay_loss, entropy_coef=entropy_coef, **extra)

    halves = [slice(0, 2), slice(2, 4)]
    totals = mini_batch_totals(mask, agg, micro_batch_size=2)
    assert totals == Totals(units={"token-mean": 13, "seq-mean-token-sum-norm": 2}.get(agg, 4), tokens=13)

    # The whole mini-batch in one call, with the same totals (for every mode but
    # seq-mean-token-sum-norm they are its own counts; that one is a mean over the 2
    # micro-batches of 2 sequences, whichever way the rows are then split).
    full_logp = logp.clone().requires_grad_()
    full_loss, full_metrics = policy_loss(
        full_logp, old_logp, advantages, mask, spec, replay_mask=replay_mask, entropy=_entropy_of(full_logp),
        totals=totals,
    )
    full_loss.backward()
    # the batch does exercise both clips
    assert full_metrics["fresh_clip_frac"] > 0 and full_metrics["dual_clip_frac"] > 0

    micro_logp = logp.clone().requires_grad_()
    summed_loss = 0.0
    for rows in halves:
        loss, _ = policy_loss(
            micro_logp[rows],
            old_logp[rows],
            advantages[rows],
            mask[rows],
            spec,
            replay_mask=replay_mask[rows],
            entropy=_entropy_of(micro_logp[rows]),
            totals=totals,
        )
        loss.backward()  # gradients accumulate in micro_logp.grad, as in a training loop
        summed_loss += loss.item()

    assert summed_loss == pytest.approx(full_loss.item(), rel=1e-12)
    torch.testing.assert_close(micro_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-15)


def test_token_mean_micro_batches_without_global_denominator_differ():
    # The control for the test above: averaging local token means weighs the 6-token
    # half's tokens more than the 7-token half's, which is not the batch's token mean.
    logp, old_logp, advantages, mask, _ = _mixed_batch()
    full_loss, _ = policy_loss(logp, old_logp, advantages, mask, DEFAULT)
    local_means = [
        policy_loss(logp[rows], old_logp[rows], advantages[rows], mask[rows], DEFAULT)[0]
        for rows in (slice(0, 2), slice(2, 4))
    ]
    assert (sum(local_means) / 2).item() != pytest.approx(full_loss.item(), rel=1e-6)


def test_totals_smaller_than_the_local_counts_are_rejected():
    logp, old_logp, advantages, mask, _ = _mixed_batch()
    with pytest.raises(ValueError, match="WHOLE mini-batch"):
        policy_loss(logp, old_logp, advantages, mask, DEFAULT, totals=Totals(units=5, tokens=13))
    with pytest.raises(ValueError, match="WHOLE mini-batch"):
        policy_loss(logp, old_logp, advantages, mask, DEFAULT, totals=Totals(units=13, tokens=5))


def test_zero_totals_give_zero_loss():
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.ones(1), torch.zeros(1, 2), DEFAULT, totals=Totals(0, 0))
    assert loss.item() == 0.0 and loss.grad_fn is not None


# ---- entropy bonus ----------------------------------------------------------------------------


def test_entropy_bonus_is_a_token_mean_whatever_the_aggregation():
    # Ratio 1, clip off: the policy term is -A per token; the bonus subtracts coef x mean entropy.
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    entropy = torch.tensor([[2.0, 4.0, 99.0], [6.0, 99.0, 99.0]], dtype=torch.float64, requires_grad=True)
    spec = LossSpec(agg="seq-mean-token-sum", norm_constant=4.0, clip_fresh=False, entropy_coef=0.5)
    loss, metrics = policy_loss(logp, torch.zeros(2, 3, dtype=torch.float64),
                                torch.tensor([1.0, 2.0], dtype=torch.float64), mask, spec, entropy=entropy)
    policy = (-2 / 4 + -2 / 4) / 2  # sequence sums over 4, averaged over 2 sequences
    assert loss.item() == pytest.approx(policy - 0.5 * (2 + 4 + 6) / 3)
    loss.backward()
    # d loss / d entropy = -coef / tokens on valid tokens, 0 on padding
    torch.testing.assert_close(entropy.grad, torch.tensor([[-1 / 6, -1 / 6, 0], [-1 / 6, 0, 0]], dtype=torch.float64))
    assert metrics["fresh_entropy"] == pytest.approx(4.0)


def test_entropy_is_only_reported_without_a_coefficient():
    logp = torch.zeros(1, 2, requires_grad=True)
    entropy = torch.tensor([[1.0, 3.0]])  # detached: computed under no_grad
    with_metric, metrics = policy_loss(logp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), DEFAULT, entropy=entropy)
    without, _ = policy_loss(logp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), DEFAULT)
    assert with_metric.item() == without.item()
    assert metrics["fresh_entropy"] == 2.0 and "replay_entropy" not in metrics


def test_an_entropy_bonus_needs_an_entropy_with_gradients():
    logp = torch.zeros(1, 2, requires_grad=True)
    spec = LossSpec(entropy_coef=0.001)
    with pytest.raises(ValueError, match="entropy is required"):
        policy_loss(logp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), spec)
    with pytest.raises(ValueError, match="must carry gradients"):
        policy_loss(logp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), spec, entropy=torch.ones(1, 2))


# ---- metrics --------------------------------------------------------------------------------


def test_metrics_by_hand():
    # Row 0 fresh: ratios 2 and 0.25 (A = +1); row 1 replayed: ratio 1 (A = -1), 1 token.
    log_two = math.log(2.0)
    logp = torch.tensor([[log_two, -2 * log_two], [0.0, 0.0]], dtype=torch.float64)
    loss, metrics = policy_loss(
        logp,
        torch.zeros(2, 2, dtype=torch.float64),
        torch.tensor([1.0, -1.0], dtype=torch.float64),
        torch.tensor([[1, 1], [1, 0]]),
        DEFAULT,
        replay_mask=torch.tensor([False, True]),
    )
    k3_two = 2 - 1 - log_two
    k3_quarter = 0.25 - 1 + 2 * log_two
    assert metrics == pytest.approx(
        {
            "fresh_tokens": 2.0,
            "replay_tokens": 1.0,
            "fresh_clip_frac": 0.5,  # ratio 2 with A > 0 is clipped, 0.25 is not
            "replay_clip_frac": 0.0,
            "dual_clip_frac": 0.0,
            "approx_kl": (k3_two + k3_quarter + 0.0) / 3,
            "advantage_mean": (1 + 1 - 1) / 3,
            "fresh_ratio_mean": 1.125,
            "fresh_ratio_min": 0.25,
            "fresh_ratio_max": 2.0,
            "replay_ratio_mean": 1.0,
            "replay_ratio_min": 1.0,
            "replay_ratio_max": 1.0,
        }
    )
    assert all(type(value) is float for value in metrics.values())
    assert loss.item() == pytest.approx((-1.28 - 0.25 + 1.0) / 3)


def test_metrics_without_replay_have_no_replay_ratio():
    _, metrics = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), DEFAULT)
    assert metrics["replay_tokens"] == 0 and metrics["replay_clip_frac"] == 0.0
    assert not any(key.startswith("replay_ratio") for key in metrics)
    assert metrics["fresh_ratio_mean"] == 1.0


# ---- argument validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_low=-0.1), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(replay_beta=0.0), "replay_beta"),
        (dict(entropy_coef=-0.1), "entropy_coef"),
        (dict(replay_loss="clipped"), "replay_loss"),
    ],
)
def test_hyperparameters_are_checked_when_the_spec_is_built(kwargs, argument):
    with pytest.raises(ValueError, match=f"LossSpec.{argument}"):
        LossSpec(**kwargs)


def test_shape_and_mask_validation():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(logp, torch.zeros(2, 2), torch.ones(2), torch.ones(2, 3), DEFAULT)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, logp, torch.ones(3), torch.ones(2, 3), DEFAULT)
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        policy_loss(logp, logp, torch.ones(2), torch.full((2, 3), 0.5), DEFAULT)
    with pytest.raises(ValueError, match="replay_mask"):
        policy_loss(logp, logp, torch.ones(2), torch.ones(2, 3), DEFAULT, replay_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, logp, torch.ones(2), torch.ones(2, 3), DEFAULT, entropy=torch.ones(2, 2))
    with pytest.raises(ValueError, match="logp must be"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.ones(3), DEFAULT)
    with pytest.raises(TypeError, match="LossSpec"):
        policy_loss(logp, logp, torch.ones(2), torch.ones(2, 3), {"agg": "token-mean"})


# ---- decoupled PPO: the behaviour policy's importance weights, truncated ------------------

def test_behaviour_weights_by_hand():
    """Three tokens of one fresh row and one of a replayed row, token-mean. Proximal (old)
    and behaviour log-probs give weights pi_prox / pi_behaviour of 0.5, 2, 8 and 1.5; with a
    cap of 4 the third is cut to 4. Each PPO token's loss is its weight times its clipped
    objective; the gradient carries the same weight."""
    cap = 4.0
    prox = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    weights = torch.tensor([[0.5, 2.0, 8.0], [1.5, 1.0, 1.0]], dtype=torch.float64)
    behaviour = prox - weights.log()
    ratios = torch.tensor([[1.1, 1.5, 0.9], [0.7, 1.0, 1.0]], dtype=torch.float64)  # pi_theta / pi_prox
    logp = ratios.log().requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, metrics = policy_loss(logp, prox, advantages, mask, LossSpec(behaviour_cap=cap),
                                replay_mask=torch.tensor([False, True]), behaviour_logp=behaviour)
    loss.backward()
    # Clipped objectives (0.2 / 0.28, dual clip 10): fresh A = 1: -1.1, -1.28 (clipped), -0.9;
    # replayed A = -2, r = 0.7: max(1.4, 2 * 0.8 = 1.6) = 1.6 (clipped).
    applied = [0.5, 2.0, 4.0, 1.5]
    objective = [-1.1, -1.28, -0.9, 1.6]
    assert loss.item() == pytest.approx(sum(w * o for w, o in zip(applied, objective)) / 4)
    # d/d logp of -A w r = -A w r where the unclipped branch is active; 0 where clipped.
    expected_grad = torch.tensor([[-0.5 * 1.1, 0.0, -4.0 * 0.9], [0.0, 0.0, 0.0]], dtype=torch.float64) / 4
    assert torch.allclose(logp.grad, expected_grad)
    assert metrics["behaviour_weight_mean"] == pytest.approx(sum(applied) / 4)
    assert metrics["behaviour_weight_max"] == pytest.approx(8.0)
    assert metrics["behaviour_truncated_frac"] == pytest.approx(0.25)


def test_behaviour_weights_leave_shaped_replay_on_the_recorded_policy():
    """ExGRPO's shaped replayed tokens take w = pi_theta / pi_behaviour (not the proximal
    policy) and no extra weight."""
    behaviour = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    prox = torch.tensor([[math.log(0.8)]], dtype=torch.float64)
    logp = torch.tensor([[math.log(0.6)]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, prox, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool),
                          LossSpec(behaviour_cap=2.0, replay_loss="shaped", replay_beta=0.1),
                          replay_mask=torch.tensor([True]), behaviour_logp=behaviour)
    w = 0.6 / 0.5
    assert loss.item() == pytest.approx(-w / (w + 0.1))


def test_behaviour_weights_need_the_behaviour_log_probs():
    with pytest.raises(ValueError, match="behaviour_logp is required"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool),
                    LossSpec(behaviour_cap=2.0))
    with pytest.raises(ValueError, match="behaviour_cap=0.0 must be a number > 0"):
        LossSpec(behaviour_cap=0.0)


def test_metrics_merged_over_micro_batches_and_ranks_equal_the_whole_mini_batchs():
    """Each metric is merged as what it is: a mean with the count of the tokens it is a mean
    over, an extreme by its direction. Fresh rows under decoupled PPO and ExGRPO's shaped
    replayed rows, split so that the micro-batches hold different shares of PPO tokens: the
    behaviour weights' mean and truncated share, means over PPO tokens, come out as the whole
    mini-batch's (weighted by all tokens, as they once were, they did not)."""
    logp, old_logp, advantages, mask, replay_mask = _mixed_batch()
    torch.manual_seed(3)
    behaviour = old_logp + torch.empty_like(old_logp, dtype=torch.float64).uniform_(-1.5, 1.5)
    spec = LossSpec(behaviour_cap=2.0, replay_loss="shaped", replay_beta=0.1)
    totals = mini_batch_totals(mask, spec.agg, micro_batch_size=2)

    def call(rows):
        _, metrics = policy_loss(logp[rows], old_logp[rows], advantages[rows], mask[rows], spec,
                                 replay_mask=replay_mask[rows], entropy=_entropy_of(logp[rows]), totals=totals,
                                 behaviour_logp=behaviour[rows])
        return metrics

    whole = call(slice(0, 4))
    ranks = []
    for micro_batches in ([[0, 3], [2]], [[1]]):  # two ranks, the first with two micro-batches
        sums = MetricSums()
        for rows in micro_batches:
            sums.add_loss_metrics(call(torch.tensor(rows)))
        ranks.append(sums.state())  # as ranks send them
    merged = MetricSums()
    for state in ranks:
        merged.merge(MetricSums(state))
    result = merged.result()
    ppo = mask.bool() & ~replay_mask[:, None]  # shaped replay: the fresh rows' tokens are the PPO ones
    assert whole["behaviour_truncated_frac"] > 0 and 0 < ppo.sum() < mask.sum()  # the case at hand
    assert set(result) == set(whole)
    for name, value in whole.items():
        assert result[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
