"""The policy-gradient loss every algorithm trains with.

The learner is algorithm-blind: GRPO/DAPO, RLEP and ExGRPO differ here only in the
arguments they pass (clipping, replay shaping, aggregation), never in code paths of
their own. See ``policy_loss`` for the tensors it expects.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["AGGREGATIONS", "LOG_RATIO_LIMIT", "loss_denominator", "policy_loss"]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
"""Accepted values of ``policy_loss(agg=...)``."""

LOG_RATIO_LIMIT = 20.0
"""|log pi_theta - log pi_old| is clamped to this before ``exp``.

A ratio of e^20 (about 5e8) is far outside any trust region already; the clamp keeps a
single diverged token (or a stale recorded log-prob) from turning the loss into inf or
NaN, at the price of a zero gradient on that token, which clipping would mostly give
it anyway.
"""


def _count_units(valid: torch.Tensor, agg: str) -> torch.Tensor:
    """What a loss of mode ``agg`` averages over: valid tokens, or non-empty sequences."""
    if agg == "token-mean":
        return valid.sum()
    return (valid.sum(dim=-1) > 0).sum()


def loss_denominator(mask: torch.Tensor, agg: str = "token-mean") -> int:
    """This micro-batch's share of the global ``denominator`` of ``policy_loss``.

    Sum the result over all micro-batches of a mini-batch and over all data-parallel
    ranks (e.g. an all-reduce with SUM) and pass that total as ``denominator``.

    Args:
        mask: [B, T] bool or 0/1 tensor of valid response tokens of one micro-batch.
        agg: the aggregation mode the loss will use (one of ``AGGREGATIONS``).

    Returns:
        The number of valid tokens (``"token-mean"``) or of sequences with at least one
        valid token (the two sequence-mean modes).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    return int(_count_units(mask.bool(), agg))


def _check_range(
    name: str, value: object, low: float, high: float | None = None, *, low_open: bool = False
) -> None:
    """Raise a ValueError naming ``name`` unless ``low <(=) value (< high)``."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value
    if ok:
        ok = value > low if low_open else value >= low
        if high is not None:
            ok = ok and value < high
    if not ok:
        bound = f"{'>' if low_open else '>='} {low}"
        if high is not None:
            bound += f" and < {high}"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 10.0,
    agg: str = "token-mean",
    replay_mask: torch.Tensor | None = None,
    replay_shaping: bool = False,
    replay_beta: float = 0.1,
    clip: bool = True,
    norm_constant: float | None = None,
    denominator: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with optional ExGRPO shaping of replayed tokens.

    Per valid token, with ``r = exp(logp - old_logp)`` and ``A`` the token's advantage:

    * tokens under the PPO objective (all fresh tokens, and replayed ones unless
      ``replay_shaping``)::

          clip=True:   loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
                       and, for A < 0, loss = min(loss, -A * dual_clip)   (dual clip)
          clip=False:  loss = -A r                       (ExGRPO's mixed phase)

      The asymmetric range is DAPO's clip-higher (0.2 / 0.28); the dual clip bounds the
      loss of a negative-advantage token whose ratio has exploded (RLEP uses c = 10).
    * replayed tokens with ``replay_shaping=True`` (ExGRPO)::

          loss = -A * w / (w + replay_beta),  w = r, never clipped

      Here ``old_logp`` must hold the log-probs RECORDED when the answer was generated,
      so that ``w`` is the importance weight pi_theta / pi_behaviour. The shaping keeps
      the gradient of stale, off-policy answers bounded (it vanishes as w grows) while
      still pushing up low-probability successes.

    Aggregation (``agg``), each divided by ``denominator`` when one is given:

    * ``"token-mean"``: sum over all valid tokens / number of valid tokens of the whole
      batch (DAPO; long answers weigh more than in a mean of sequence means).
    * ``"seq-mean-token-mean"``: mean over sequences of each sequence's token mean.
    * ``"seq-mean-token-sum"``: mean over sequences of (token sum / ``norm_constant``),
      Dr.GRPO (``norm_constant`` = max response length) and ExGRPO (8192).

    Sequences without any valid token are padding: they add nothing and are not
    counted in either sequence mode.

    Micro-batches and data parallelism (the ``denominator`` contract): when one
    mini-batch is split into micro-batches, possibly across ranks, pass to every call
    the GLOBAL count of the mini-batch: the number of valid tokens (``"token-mean"``) or
    the number of sequences with at least one valid token (sequence modes), i.e. the
    sum of ``loss_denominator(micro_mask, agg)`` over all micro-batches of all ranks.
    Each call then returns ``(sum of its own per-unit terms) / denominator``, so the SUM
    of the returned losses over micro-batches and ranks equals the loss of the whole
    mini-batch in one call, and so do the accumulated gradients. Do not average the
    micro-batch losses again. Data-parallel wrappers that AVERAGE gradients across
    ranks (DDP, FSDP) divide by the world size: multiply the loss by the world size
    before ``backward`` to recover the sum. Without ``denominator`` the local count
    is used (right for a single call over the whole mini-batch).

    Args:
        logp: [B, T] log-probs of the response tokens under the current policy; the
            tensor gradients flow through. Values at invalid positions are ignored
            (they may be anything, including -inf).
        old_logp: [B, T] log-probs of the same tokens under the old policy (the one
            that made the data, or a recomputation at the start of the step); for
            replayed rows with ``replay_shaping`` the recorded behaviour log-probs.
            Treated as a constant.
        advantages: [B] one advantage per sequence, or [B, T] per token. Constant.
        mask: [B, T] bool or 0/1 tensor, True on valid response tokens.
        clip_low: lower clip range, ratio floor is ``1 - clip_low``; in [0, 1).
        clip_high: upper clip range, ratio ceiling is ``1 + clip_high``; >= 0.
        dual_clip: bound ``c`` of the dual clip for A < 0, > 1; None disables it.
        agg: one of ``AGGREGATIONS``.
        replay_mask: [B] bool or 0/1, True for rows that are replayed answers rather
            than fresh rollouts; None means all rows are fresh.
        replay_shaping: apply ExGRPO's ``f(w) = w / (w + replay_beta)`` to replayed
            tokens instead of the PPO objective.
        replay_beta: ``beta`` of the shaping function, > 0.
        clip: False removes clipping (and the dual clip) from the PPO-objective tokens.
        norm_constant: divisor of each sequence's token sum; required by and only
            accepted with ``agg="seq-mean-token-sum"``; > 0.
        denominator: global unit count of the mini-batch (see above), a number or a
            0-d tensor (e.g. straight from an all-reduce); >= this call's own count. A global count of 0 (nothing valid anywhere) gives a loss of 0.

    Returns:
        ``(loss, metrics)``. ``loss`` is a 0-d float tensor (float32, or float64 when
        ``logp`` is) connected to ``logp``'s graph, 0.0 when nothing is valid.
        ``metrics`` holds detached python floats:

        * ``fresh_tokens``, ``replay_tokens``: number of valid tokens of each kind;
        * ``fresh_clip_frac``, ``replay_clip_frac``: share of that kind's tokens whose
          clipped branch is the active one (zero gradient); 0.0 for unclipped or
          shaped tokens;
        * ``dual_clip_frac``: share of all valid tokens bounded by the dual clip;
        * ``fresh_ratio_{mean,min,max}``, ``replay_ratio_{mean,min,max}``: the ratio
          ``r`` over that kind's tokens, present only when there is such a token;
        * ``approx_kl``: k3 estimate ``mean(r - 1 - log r)`` of KL(pi_old || pi_theta)
          over valid tokens;
        * ``advantage_mean``: mean advantage per valid token.

        Statistics over an empty set are 0.0 (or absent, for the ratio ones), never NaN.

    Raises:
        ValueError: a shape mismatch, a mask that is not 0/1, an out-of-range
            hyper-parameter, an unknown ``agg``, a missing or misplaced
            ``norm_constant``, or a ``denominator`` smaller than the local count.
    """
    # ---- validation: a wrong argument fails here, naming itself -------------------
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    batch_size = logp.shape[0]
    for name, tensor in (("old_logp", old_logp), ("mask", mask)):
        if tensor.shape != logp.shape:
            raise ValueError(
                f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(tensor.shape)}"
            )
    if advantages.shape not in (logp.shape, (batch_size,)):
        raise ValueError(
            f"advantages must be [B]={batch_size} or [B, T]={tuple(logp.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    if mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
        raise ValueError("mask must hold only 0 and 1 (it selects tokens; it does not weight them)")
    if replay_mask is not None and replay_mask.shape != (batch_size,):
        raise ValueError(f"replay_mask must be [B]={batch_size}, got {tuple(replay_mask.shape)}")
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    _check_range("clip_low", clip_low, 0.0, 1.0)
    _check_range("clip_high", clip_high, 0.0)
    if dual_clip is not None:
        _check_range("dual_clip", dual_clip, 1.0, low_open=True)
    _check_range("replay_beta", replay_beta, 0.0, low_open=True)
    if agg == "seq-mean-token-sum":
        if norm_constant is None:
            raise ValueError("norm_constant is required with agg='seq-mean-token-sum'")
        _check_range("norm_constant", norm_constant, 0.0, low_open=True)
    elif norm_constant is not None:
        raise ValueError(f"norm_constant only applies to agg='seq-mean-token-sum', not agg={agg!r}")

    # ---- per-token ratios ------------------------------------------------------------
    # bf16 log-probs lose most of a ratio's precision in exp; compute in at least fp32.
    compute_dtype = torch.promote_types(logp.dtype, torch.float32)
    valid = mask.bool()
    # Padding may hold -inf or garbage; zero it BEFORE exp so that neither the forward
    # value nor the backward pass (0 * inf = NaN) can see it.
    raw_log_ratio = logp.to(compute_dtype) - old_logp.detach().to(compute_dtype)
    log_ratio = torch.where(valid, raw_log_ratio, 0.0)
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = log_ratio.exp()

    token_advantages = advantages.detach().to(compute_dtype)
    if token_advantages.dim() == 1:
        token_advantages = token_advantages.unsqueeze(-1).expand_as(ratio)
    token_advantages = torch.where(valid, token_advantages, 0.0)

    if replay_mask is None:
        replay_rows = torch.zeros_like(valid)
    else:
        replay_rows = replay_mask.bool().unsqueeze(-1).expand_as(valid)
    replay_tokens = valid & replay_rows
    fresh_tokens = valid & ~replay_rows
    shaped_tokens = replay_tokens if replay_shaping else torch.zeros_like(valid)

    # ---- per-token loss --------------------------------------------------------------
    unclipped_loss = -token_advantages * ratio
    no_flags = torch.zeros_like(valid)
    if clip:
        clipped_loss = -token_advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        # The pessimistic (larger) of the two, selected with the same mask the clip
        # fraction reports, so the metric and the gradient can never disagree.
        clip_active = (clipped_loss > unclipped_loss) & ~shaped_tokens
        ppo_loss = torch.where(clip_active, clipped_loss, unclipped_loss)
        if dual_clip is not None:
            dual_bound = -token_advantages * dual_clip  # a constant: zero gradient once active
            dual_active = (token_advantages < 0) & (ppo_loss > dual_bound) & ~shaped_tokens
            ppo_loss = torch.where(dual_active, dual_bound, ppo_loss)
        else:
            dual_active = no_flags
    else:
        clip_active = dual_active = no_flags
        ppo_loss = unclipped_loss

    if replay_shaping:
        shaped_loss = -token_advantages * (ratio / (ratio + replay_beta))
        token_loss = torch.where(shaped_tokens, shaped_loss, ppo_loss)
    else:
        token_loss = ppo_loss
    token_loss = token_loss.masked_fill(~valid, 0.0)

    # ---- aggregation -----------------------------------------------------------------
    if agg == "token-mean":
        loss_sum = token_loss.sum()
    else:
        sequence_sums = token_loss.sum(dim=-1)
        if agg == "seq-mean-token-mean":
            # Empty sequences have a sum of 0, so clamping their count only avoids 0/0.
            sequence_values = sequence_sums / valid.sum(dim=-1).clamp(min=1)
        else:
            sequence_values = sequence_sums / norm_constant
        loss_sum = sequence_values.sum()

    local_units = int(_count_units(valid, agg))
    if denominator is None:
        divisor = local_units
    else:
        denominator_value = float(denominator)
        if not denominator_value >= local_units:
            raise ValueError(
                f"denominator ({denominator_value:g}) must be the GLOBAL count of the mini-batch, "
                f"at least this micro-batch's own count ({local_units}) for agg={agg!r}"
            )
        divisor = denominator_value
    # A zero count means nothing is valid and loss_sum is exactly 0: divide by 1 so the
    # loss stays 0.0 (not NaN) and keeps its graph, so backward still runs.
    loss = loss_sum / max(divisor, 1)

    metrics = _loss_metrics(
        ratio=ratio.detach(),
        log_ratio=log_ratio.detach(),
        token_advantages=token_advantages,
        valid=valid,
        fresh_tokens=fresh_tokens,
        replay_tokens=replay_tokens,
        clip_active=clip_active,
        dual_active=dual_active,
    )
    return loss, metrics


@torch.no_grad()
def _loss_metrics(
    *,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    token_advantages: torch.Tensor,
    valid: torch.Tensor,
    fresh_tokens: torch.Tensor,
    replay_tokens: torch.Tensor,
    clip_active: torch.Tensor,
    dual_active: torch.Tensor,
) -> dict[str, float]:
    """Diagnostics of one ``policy_loss`` call; all inputs are [B, T]."""
    zero = ratio.new_zeros(())

    def mean_over(values: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        count = selected.sum()
        return torch.where(count > 0, (values * selected).sum() / count.clamp(min=1), zero)

    def extreme_over(values: torch.Tensor, selected: torch.Tensor, largest: bool) -> torch.Tensor:
        # Fill the unselected with the neutral element instead of indexing with the
        # mask, which would force a device sync per call; empty sets are dropped below.
        if largest:
            return values.masked_fill(~selected, -torch.inf).amax().nan_to_num(neginf=0.0)
        return values.masked_fill(~selected, torch.inf).amin().nan_to_num(posinf=0.0)

    stats: dict[str, torch.Tensor] = {
        "fresh_tokens": fresh_tokens.sum().to(ratio.dtype),
        "replay_tokens": replay_tokens.sum().to(ratio.dtype),
        "fresh_clip_frac": mean_over(clip_active.to(ratio.dtype), fresh_tokens),
        "replay_clip_frac": mean_over(clip_active.to(ratio.dtype), replay_tokens),
        "dual_clip_frac": mean_over(dual_active.to(ratio.dtype), valid),
        "approx_kl": mean_over(ratio - 1.0 - log_ratio, valid),
        "advantage_mean": mean_over(token_advantages, valid),
    }
    for kind, selected in (("fresh", fresh_tokens), ("replay", replay_tokens)):
        stats[f"{kind}_ratio_mean"] = mean_over(ratio, selected)
        stats[f"{kind}_ratio_min"] = extreme_over(ratio, selected, largest=False)
        stats[f"{kind}_ratio_max"] = extreme_over(ratio, selected, largest=True)

    # One device-to-host copy for all of them, not one sync per metric.
    values = dict(zip(stats, torch.stack(list(stats.values())).tolist()))
    for kind in ("fresh", "replay"):
        if values[f"{kind}_tokens"] == 0:
            for suffix in ("mean", "min", "max"):
                del values[f"{kind}_ratio_{suffix}"]
    return values
