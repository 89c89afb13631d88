"""The training-inference mismatch: the engines' log-probs of the tokens they sampled (vLLM,
its kernels and dtype) against the learner's for the same tokens and weights (FSDP, fp32
masters).

In terms of the per-token log ratio ``d_t = log pi_learner(y_t) - log pi_engine(y_t)`` over
an answer's response tokens, `mismatch_sums` gives what verl's rollout correction reports
(`rollout_corr_helper`, the same formulas for the same inputs): the KL of the engine's
policy from the learner's (``mean(-d)``, and the k3 estimator ``mean(exp(d) - d - 1)``),
each policy's perplexity per answer and their ratio, and the chi-square divergences of the
ratio at token and answer level, with exponents clamped to +-20 where verl clamps them.

`correct` applies what verl 0.9's rollout correction applies, with its names and formulas:
truncated importance weights ``min(r_t, cap)`` per token or ``min(exp(clamp(sum_t d_t)), cap)``
per answer, or IcePop's (0 outside ``[lower, cap]``) (`importance_weights`); rejection rules
on a per-token divergence of ``d`` clamped to +-20 (k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d),
as it is or the answer's sum, mean or largest (`kept_by_rejection`; `rayrep.types.Rejection`);
and rayrep's own veto, which drops an answer with any token's ``r_t < veto``, on ``d``
unclamped (`kept_by_veto`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rayrep.learner.loss import LOG_RATIO_LIMIT
from rayrep.types import MismatchCorrection, Rejection

BOUND = LOG_RATIO_LIMIT
"""Log ratios are clamped to [-BOUND, BOUND] before `exp` and the divergences, where verl clamps
them (its SAFETY_BOUND, the loss's own limit): exp(20) is about 4.9e8."""


def _row_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] sum of each row's values over its valid tokens (padding left out, whatever it holds)."""
    return torch.where(mask.bool(), values, 0.0).sum(-1)


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] mean of each row's values over its valid tokens (0 for a row without any)."""
    return _row_sum(values, mask) / mask.sum(-1).clamp_min(1)


def mismatch_sums(learner_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor
                  ) -> dict[str, tuple[float, float]]:
    """What the mismatch is, as (sum, count) pairs, so that ranks and micro-batches add up
    (`rayrep.learner.sums.MetricSums`): token means over valid tokens, sequence means over
    rows with a valid token.

    - `mismatch_kl`: KL(engine || learner) by its direct estimator, mean of -d;
    - `mismatch_k3_kl`: the same by k3, mean of exp(d) - d - 1 (d not clamped);
    - `mismatch_learner_ppl`, `mismatch_engine_ppl`: each policy's perplexity per sequence,
      exp(-mean log-prob), averaged over sequences;
    - `mismatch_log_ppl_diff`: mean over sequences of mean(engine) - mean(learner) log-prob;
      `mismatch_ppl_ratio`: mean over sequences of exp of it (learner's perplexity over the engine's);
    - `mismatch_chi2_token`: mean of exp(d)^2, less 1; `mismatch_chi2_seq`: mean over
      sequences of exp(sum d)^2, less 1 (both with the exponent clamped).
    """
    valid = mask.bool()
    d = torch.where(valid, learner_logp - engine_logp, 0.0)
    rows = valid.any(-1)
    tokens, sequences = valid.sum().to(d.dtype), rows.sum().to(d.dtype)
    learner_mean, engine_mean = _row_mean(learner_logp, mask)[rows], _row_mean(engine_logp, mask)[rows]
    log_ppl_diff = engine_mean - learner_mean
    clamped = d.clamp(-BOUND, BOUND)
    row_sum = _row_sum(d, mask)[rows].clamp(-BOUND, BOUND)

    def over_tokens(values: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, values, 0.0).sum()

    per_token = {
        "mismatch_kl": over_tokens(-d),
        "mismatch_k3_kl": over_tokens(torch.exp(d) - d - 1),  # (unclamped, as verl's: inf past exp's range)
        # E[rho^2] - 1 as a sum over tokens: the count's worth of 1 taken off.
        "mismatch_chi2_token": over_tokens(torch.exp(clamped).square()) - tokens,
    }
    per_sequence = {
        "mismatch_learner_ppl": torch.exp(-learner_mean).sum(),
        "mismatch_engine_ppl": torch.exp(-engine_mean).sum(),
        "mismatch_log_ppl_diff": log_ppl_diff.sum(),
        "mismatch_ppl_ratio": torch.exp(log_ppl_diff).sum(),
        "mismatch_chi2_seq": torch.exp(2.0 * row_sum).sum() - sequences,
    }
    # One device-to-host copy for all of them, not one sync per metric (as `policy_loss`).
    *totals, token_count, sequence_count = torch.stack(
        [*per_token.values(), *per_sequence.values(), tokens, sequences]).tolist()
    counts = [token_count] * len(per_token) + [sequence_count] * len(per_sequence)
    return {name: (total, count) for name, total, count in zip([*per_token, *per_sequence], totals, counts)}


WeightLevel = Literal["token", "sequence"]


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[N, L] the log ratio a weight of `level` looks at, per position: the token's own, or its
    row's sum over valid tokens ('sequence')."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return _row_sum(log_ratio, mask)[:, None].expand_as(log_ratio)
    raise ValueError(f"unknown mismatch level {level!r}: token or sequence")


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: WeightLevel, cap: float,
                       lower: float | None = None) -> torch.Tensor:
    """[N, L] importance weights pi_learner / pi_engine at `level` (the answer's: the exponent's
    sum clamped, as verl clamps it), truncated at `cap`, or with `lower` IcePop's: 0 outside
    [lower, cap]; zero on padding, detached."""
    if level not in ("token", "sequence"):
        raise ValueError(f"importance weights are per token or per sequence, not {level!r}")
    ratio = torch.exp(level_log_ratio(log_ratio, mask, level).clamp(-BOUND, BOUND)) * mask
    if lower is None:
        return ratio.clamp(max=cap).detach()
    return torch.where((ratio >= lower) & (ratio <= cap), ratio, 0.0).detach()


def kept_by_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, rule: Rejection) -> torch.Tensor:
    """[N, L] bool: the valid tokens `rule` keeps (verl's `compute_rollout_rejection_mask` for
    one option): each token's log ratio clamped to +-BOUND, its divergence, that or the
    answer's sum / mean / largest over its valid tokens (an answer's decision is each of its
    tokens'), kept when ``log(lower) <= k1 statistic <= log(upper)`` or ``k2 / k3 <= upper``."""
    valid = mask.bool()
    d = torch.where(valid, log_ratio, 0.0).clamp(-BOUND, BOUND)
    divergence = {"k1": -d, "k2": 0.5 * d.square(), "k3": torch.exp(d) - 1.0 - d}[rule.divergence]
    if rule.aggregate == "token":
        statistic = divergence
    elif rule.aggregate == "seq_max":
        largest = divergence.masked_fill(~valid, -torch.inf).amax(-1)
        statistic = torch.where(valid.any(-1), largest, 0.0)[:, None]
    else:
        row = _row_sum(divergence, mask) if rule.aggregate == "seq_sum" else _row_mean(divergence, mask)
        statistic = row[:, None]
    if rule.divergence == "k1":
        kept = (statistic >= math.log(rule.lower)) & (statistic <= math.log(rule.upper))
    else:
        kept = statistic <= rule.upper
    return valid & kept


def kept_by_veto(log_ratio: torch.Tensor, mask: torch.Tensor, veto: float) -> torch.Tensor:
    """[N] bool: rows none of whose valid tokens has a ratio below `veto` (> 0)."""
    if not veto > 0:
        raise ValueError(f"the veto threshold must be > 0, got {veto!r}")
    catastrophic = mask.bool() & (log_ratio < torch.log(torch.tensor(veto, dtype=log_ratio.dtype)))
    return ~catastrophic.any(-1)


@dataclass(frozen=True)
class Corrected:
    """What a `MismatchCorrection` makes of a batch's fresh rows."""

    kept: torch.Tensor
    """[N, L] bool: the valid tokens left in the loss (all of them unless it rejects)."""
    weights: torch.Tensor | None
    """[N, L] the truncated importance weights of the PPO loss (None: it weighs nothing)."""


def correct(learner_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
            correction: MismatchCorrection) -> Corrected:
    """verl's rollout correction of rows sampled by the engines (decoupled mode: the ratio of
    the learner's log-probs at the update's start to the engines'): every rejection rule and
    the veto (a token stays if each keeps it), then the weights."""
    valid = mask.bool()
    log_ratio = torch.where(valid, learner_logp - engine_logp, 0.0)
    kept = valid
    for rule in correction.rejections:
        kept = kept & kept_by_rejection(log_ratio, mask, rule)
    if correction.veto is not None:
        kept = kept & kept_by_veto(log_ratio, mask, correction.veto)[:, None]
    weights = None
    if correction.weights != "none":
        weights = importance_weights(log_ratio, mask, correction.weights, correction.weight_cap,
                                     correction.weight_lower)
    return Corrected(kept=kept, weights=weights)


def correction_sums(mask: torch.Tensor, corrected: Corrected, correction: MismatchCorrection
                    ) -> dict[str, tuple[float, float]]:
    """What the correction did, as (sum, count) pairs: the share of valid tokens and of
    answers it took out of the loss (`mismatch_masked_tokens`, `mismatch_masked_sequences`),
    and of its weights, their mean over valid tokens and the share the cap truncated (IcePop's:
    the share set to 0) (`mismatch_weight_mean`, `mismatch_truncated_tokens`)."""
    valid = mask.bool()
    rows = valid.any(-1)
    taken = valid & ~corrected.kept
    sums = {"mismatch_masked_tokens": (taken.sum(), valid.sum()),
            "mismatch_masked_sequences": (taken.any(-1)[rows].sum(), rows.sum())}
    if corrected.weights is not None:
        sums["mismatch_weight_mean"] = (torch.where(valid, corrected.weights, 0.0).sum(), valid.sum())
        # Truncated: the weight equals the cap where the ratio went past it (weights are min(r, cap));
        # IcePop's: 0 where the ratio left the band (verl's rollout_is_oob_ratio).
        cut = corrected.weights >= correction.weight_cap if correction.weight_lower is None else corrected.weights == 0
        sums["mismatch_truncated_tokens"] = ((valid & cut).sum(), valid.sum())
    # One device-to-host copy for all of them.
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=mask.device)
                          for pair in sums.values() for v in pair]).tolist()
    return {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(sums)}
