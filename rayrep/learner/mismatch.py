"""The training-inference mismatch: the engines' log-probs of the tokens they sampled (vLLM,
its kernels and dtype) against the learner's for the same tokens and weights (FSDP, fp32
masters).

In terms of the per-token log ratio ``d_t = log pi_learner(y_t) - log pi_engine(y_t)`` over
an answer's response tokens, `mismatch_sums` gives what verl's rollout correction reports
(`rollout_corr_helper`, the same formulas for the same inputs): the KL of the engine's
policy from the learner's (``mean(-d)``, and the k3 estimator ``mean(exp(d) - d - 1)``),
each policy's perplexity per answer and their ratio, and the chi-square divergences of the
ratio at token and answer level, with exponents clamped to +-20 where verl clamps them.
"""

from __future__ import annotations

from typing import Literal

import torch

BOUND = 20.0
"""Exponents are clamped to [-BOUND, BOUND] before `exp` (the chi-square terms): exp(20) is about 4.9e8."""


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
RejectLevel = Literal["token", "sequence", "geometric"]


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[N, L] the log ratio a weight or a rejection of `level` looks at, per position: the
    token's own, or its row's sum ('sequence') or mean ('geometric') over valid tokens."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return _row_sum(log_ratio, mask)[:, None].expand_as(log_ratio)
    if level == "geometric":
        return _row_mean(log_ratio, mask)[:, None].expand_as(log_ratio)
    raise ValueError(f"unknown mismatch level {level!r}: token, sequence or geometric")


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: WeightLevel, cap: float) -> torch.Tensor:
    """[N, L] truncated importance weights pi_learner / pi_engine at `level`, at most `cap`,
    zero on padding, detached."""
    if level not in ("token", "sequence"):
        raise ValueError(f"importance weights are per token or per sequence, not {level!r}")
    ratio = torch.exp(level_log_ratio(log_ratio, mask, level).clamp(-BOUND, BOUND))
    return (ratio * mask).clamp(max=cap).detach()


def kept_by_band(log_ratio: torch.Tensor, mask: torch.Tensor, level: RejectLevel, upper: float,
                 lower: float | None = None) -> torch.Tensor:
    """[N, L] bool: valid tokens whose ratio at `level` lies in [lower, upper] (`lower`:
    1 / upper unless given); the rest leave the loss."""
    lower = 1.0 / upper if lower is None else lower
    ratio = torch.exp(level_log_ratio(log_ratio, mask, level).clamp(-BOUND, BOUND))
    return mask.bool() & (ratio >= lower) & (ratio <= upper)


def kept_by_veto(log_ratio: torch.Tensor, mask: torch.Tensor, veto: float) -> torch.Tensor:
    """[N] bool: rows none of whose valid tokens has a ratio below `veto` (> 0)."""
    if not veto > 0:
        raise ValueError(f"the veto threshold must be > 0, got {veto!r}")
    catastrophic = mask.bool() & (log_ratio < torch.log(torch.tensor(veto, dtype=log_ratio.dtype)))
    return ~catastrophic.any(-1)


def masked_shares(mask: torch.Tensor, kept: torch.Tensor) -> dict[str, tuple[float, float]]:
    """The share of valid tokens, and of rows with a valid token, that rejection and veto
    took out of the loss (`kept`: [N, L] bool, the valid tokens left), as (sum, count) pairs."""
    valid = mask.bool()
    rows = valid.any(-1)
    taken = valid & ~kept
    return {"mismatch_masked_tokens": (float(taken.sum()), float(valid.sum())),
            "mismatch_masked_sequences": (float(taken.any(-1)[rows].sum()), float(rows.sum()))}


def truncated_share(log_ratio: torch.Tensor, mask: torch.Tensor, level: WeightLevel, cap: float
                    ) -> tuple[float, float]:
    """The share of valid tokens whose importance weight the cap truncated, as a (sum, count) pair."""
    over = mask.bool() & (level_log_ratio(log_ratio, mask, level) > torch.log(torch.tensor(cap, dtype=log_ratio.dtype)))
    return float(over.sum()), float(mask.bool().sum())
