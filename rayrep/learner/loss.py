"""The policy-gradient loss every algorithm trains with, defined once.

The learner is algorithm-blind: GRPO/DAPO, RLEP and ExGRPO differ only in the `LossSpec`
they build (`rayrep.types.LossSpec`: clipping, which tokens it applies to, replay
shaping, aggregation, entropy bonus), never in code paths of their own. `policy_loss` is
composed of one small function per step below.

Per valid token, with ``r = exp(logp - old_logp)`` and ``A`` the token's advantage:

* tokens under the policy objective (fresh tokens; replayed ones unless
  ``spec.replay_loss == "shaped"``), by ``spec.objective``:

  - ``"ppo"``::

      clipped:    loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
                  and, for A < 0, loss = min(loss, -A * dual_clip)   (dual clip)
      unclipped:  loss = -A r        (fresh tokens when not spec.clip_fresh)

    The asymmetric range is DAPO's clip-higher (0.2 / 0.28); the dual clip bounds the
    loss of a negative-advantage token whose ratio has exploded (RLEP uses c = 10).
  - ``"gspo"`` (GSPO; verl ``compute_policy_loss_gspo``): PPO's clip on the answer's
    geometric-mean ratio ``s = exp(mean_t log r_t)`` over its tokens under the objective,
    in the per-token form whose value is ``s`` and whose gradient is ``s`` times the token's
    log-prob's::

      log s_t = min(logp_t - sg(logp_t) + sg(log s), 10)
      loss    = max(-A s_t, -A clip(s_t, 1 - clip_low, 1 + clip_high))   (unclipped: -A s_t)

    so every token of an answer is clipped, or not, together. No dual clip.
  - ``"cispo"`` (MiniMax-M1's CISPO; verl ``compute_policy_loss_cispo``): the clipped ratio
    as a constant weight on the log-prob, so that no token's gradient is dropped::

      loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp      (unclipped: sg(r))

  - ``"sapo"`` (SAPO; verl ``compute_policy_loss_sapo``): a soft gate instead of a clip,
    whose slope is 1 at r = 1 and fades away from it (tau: ``sapo_tau_pos`` for A > 0, else
    ``sapo_tau_neg``)::

      loss = -A * sigmoid(tau (r - 1)) * 4 / tau

  Replayed tokens under the objective are always clipped.
* replayed tokens with ``spec.replay_loss == "shaped"`` (ExGRPO)::

      loss = -A * w / (w + replay_beta),  w = r, never clipped

  Here ``old_logp`` must hold the log-probs RECORDED when the answer was generated,
  so that ``w`` is the importance weight pi_theta / pi_behaviour. The shaping keeps
  the gradient of stale, off-policy answers bounded (it vanishes as w grows) while
  still pushing up low-probability successes.

Aggregation (``spec.agg``), divided by ``totals.units``:

* ``"token-mean"``: sum over all valid tokens / number of valid tokens (DAPO; long
  answers weigh more than in a mean of sequence means).
* ``"seq-mean-token-mean"``: mean over sequences of each sequence's token mean.
* ``"seq-mean-token-sum"``: mean over sequences of (token sum / ``norm_constant``),
  Dr.GRPO (``norm_constant`` = max response length).
* ``"seq-mean-token-sum-norm"`` (verl's mode of that name, which the ExGRPO code trains
  with, ``norm_constant`` = 8192): each micro-batch of m sequences contributes its
  token sum / ``norm_constant``, and the mini-batch loss is the mean over its
  micro-batches, as gradient accumulation divides by the number of micro-batches::

      L = (m / N) * sum_{i,t} l_{i,t} / norm_constant     (N sequences, m = micro_batch_size,
                                                            N / m micro-batches, rounded up)

  m times the ``seq-mean-token-sum`` loss of the same batch: the entropy coefficient,
  the grad clip and a skip threshold act at the scale they were tuned at.

Sequences without any valid token are padding: they add nothing and are not counted.

Decoupled PPO (``spec.behaviour_cap`` set; AReaL's form): ``old_logp`` holds the
proximal policy's log-probs (the learner's weights when the update began) and
``behaviour_logp`` those the answers were sampled with; every policy-objective token's
loss above is multiplied by a constant weight::

    loss_t = min(pi_prox / pi_behaviour, behaviour_cap) * loss_t

so answers from an older policy (asynchronous rollouts, replayed answers) are
corrected by importance sampling, with the variance bounded by the cap, while the
trust region is taken around the current weights. Shaped replayed tokens take their
``w`` against ``behaviour_logp`` and no extra weight.

The mismatch correction (``spec.correction``; `rayrep.learner.mismatch`) acts on fresh
tokens, whose ``behaviour_logp`` are the engines' log-probs at (about) the same weights as
``old_logp``: the caller takes the tokens it rejects out of ``mask`` and ``totals`` (every
rank must know the mini-batch's counts first) and passes its truncated weights, which
multiply those tokens' policy-objective losses as the decoupled weights do.

KL penalty to the reference policy (``spec.kl_coef > 0``; verl's ``use_kl_loss``): the loss
adds ``kl_coef x`` the aggregation (as above, over the same tokens and units) of a per-token
estimate of KL(pi_theta || pi_ref) from ``ref_logp`` (`kl_penalty`; ``spec.kl_estimator``).

Entropy bonus: with ``spec.entropy_coef > 0`` the loss subtracts ``entropy_coef x``
the sum of ``entropy`` over valid tokens / ``totals.tokens``; ``entropy`` must then
carry gradients. With a zero coefficient, pass it detached (computed under
``no_grad``: at paper scale each extra fp32 [micro, L, V] tensor kept for backward is
about 10 GB), or not at all; it is only reported.

Micro-batches and data parallelism: when one mini-batch is split into micro-batches,
possibly across ranks, pass every call the same ``mini_batch_totals`` of the WHOLE
mini-batch. Each call then returns its own share, so the SUM of the returned losses
over micro-batches and ranks equals the loss of the whole mini-batch in one call,
and so do the accumulated gradients. Data-parallel wrappers that AVERAGE gradients
across ranks (DDP, FSDP) divide by the world size: multiply the loss by the world
size before ``backward`` to recover the sum. Without ``totals`` a call's own counts
are used (right for one call over the whole mini-batch).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from rayrep.types import AGGREGATIONS, Aggregation, LossSpec

__all__ = ["GSPO_LOG_RATIO_CAP", "KL_CLAMP", "LOG_RATIO_LIMIT", "LossMetrics", "Totals", "kl_penalty",
           "mini_batch_totals", "policy_loss"]

LOG_RATIO_LIMIT = 20.0
"""|log pi_theta - log pi_old| is clamped to this before ``exp``.

A ratio of e^20 (about 5e8) is far outside any trust region already; the clamp keeps a
single diverged token (or a stale recorded log-prob) from turning the loss into inf or
NaN, at the price of a zero gradient on that token, which clipping would mostly give
it anyway.
"""

GSPO_LOG_RATIO_CAP = 10.0
"""GSPO's sequence log-ratio is capped above at this, as verl's ``compute_policy_loss_gspo``
caps it (an answer's ratio of e^10 is clipped whatever its advantage's sign)."""

KL_CLAMP = 10.0
"""The k3 estimate of each token is clamped to +-this, as verl's ``low_var_kl`` clamps it."""


@dataclass(frozen=True)
class Totals:
    """Counts over a WHOLE mini-batch (every micro-batch on every rank): what one
    micro-batch's loss is divided by, so that the micro-batch losses sum to the
    mini-batch's loss."""

    units: float
    """What the aggregation averages over: valid tokens (token-mean), non-empty sequences
    (seq-mean-...), or micro-batches (seq-mean-token-sum-norm)."""
    tokens: float
    """Valid response tokens (the entropy bonus is a token mean whatever the aggregation)."""


def _totals(row_tokens: torch.Tensor, agg: Aggregation, micro_batch_size: int | None) -> Totals:
    """The `Totals` of rows with these valid token counts ([B])."""
    tokens = float(row_tokens.sum())
    if agg == "token-mean":
        return Totals(units=tokens, tokens=tokens)
    sequences = float((row_tokens > 0).sum())
    if agg == "seq-mean-token-sum-norm":
        if not micro_batch_size:
            raise ValueError("agg='seq-mean-token-sum-norm' needs micro_batch_size (its loss is a mean over micro-batches)")
        sequences = float(math.ceil(sequences / micro_batch_size))  # the micro-batches it splits into
    return Totals(units=sequences, tokens=tokens)


def mini_batch_totals(mask: torch.Tensor, agg: Aggregation = "token-mean", micro_batch_size: int | None = None) -> Totals:
    """The `Totals` of the rows in `mask` ([B, T] valid response tokens), or of rows with
    these valid token counts (`mask` [B]: what a rejection left of each row, which only the
    row's rank knows): call it on the whole mini-batch's and pass the result to every
    micro-batch's `policy_loss`. `micro_batch_size` (sequences per micro-batch) is needed by
    'seq-mean-token-sum-norm' only."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    return _totals(mask.bool().sum(-1) if mask.dim() == 2 else mask, agg, micro_batch_size)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
    *,
    replay_mask: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    totals: Totals | None = None,
    behaviour_logp: torch.Tensor | None = None,
    correction_weights: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """Clipped policy-gradient loss with ExGRPO's shaping of replayed tokens and an
    optional entropy bonus, as `spec` says: the formulas, aggregations, decoupled PPO and the
    rule for micro-batches are in this module's docstring.

    Args:
        logp: [B, T] log-probs of the response tokens under the current policy; the
            tensor gradients flow through. Values at invalid positions are ignored
            (they may be anything, including -inf).
        old_logp: [B, T] log-probs of the same tokens under the old policy (the one
            that made the data, or a recomputation at the start of the step); for
            shaped replayed rows the recorded behaviour log-probs. A constant.
        advantages: [B] one advantage per sequence, or [B, T] per token. A constant.
        mask: [B, T] bool or 0/1 tensor, True on valid response tokens.
        spec: the loss to compute (validated when it was built).
        replay_mask: [B] bool or 0/1, True for rows that are replayed answers rather
            than fresh rollouts; None means all rows are fresh.
        entropy: [B, T] per-token entropy of the current policy; required when
            ``spec.entropy_coef > 0``, optional (for the metrics) otherwise.
        totals: counts of the whole mini-batch; each at least this call's.
        behaviour_logp: [B, T] the recorded behaviour log-probs; required when
            ``spec.behaviour_cap`` is set (and only then used).
        correction_weights: [B, T] constant weights of the policy-objective tokens' losses (the
            mismatch correction's truncated importance weights, 1 on rows it leaves alone;
            `rayrep.learner.mismatch.correct`); its rejection is the caller's, in ``mask``
            and ``totals``.
        ref_logp: [B, T] the reference policy's log-probs of the same tokens; required when
            ``spec.kl_coef > 0`` (and only then used). A constant.

    Returns:
        ``(loss, metrics)``. ``loss`` is a 0-d float tensor (float32, or float64 when
        ``logp`` is) connected to ``logp``'s graph, 0.0 when nothing is valid. ``metrics``:
        a `LossMetrics` of detached python floats (`_loss_metrics`, `_behaviour_metrics`).

    Raises:
        ValueError: a shape mismatch, a mask that is not 0/1, totals smaller than this
            call's own counts, or an entropy that cannot carry the bonus's gradient.
    """
    _check_arguments(logp, old_logp, advantages, mask, spec, replay_mask, entropy, behaviour_logp, correction_weights,
                     ref_logp)
    # bf16 log-probs lose most of a ratio's precision in exp; compute in at least fp32.
    compute_dtype = torch.promote_types(logp.dtype, torch.float32)
    tokens = _TokenSets.of(mask, replay_mask, spec)
    log_ratio, ratio = _clamped_ratio(logp, old_logp, tokens.valid, compute_dtype)
    token_advantages = _token_advantages(advantages, tokens.valid, ratio, compute_dtype)

    token_loss, clip_active, dual_active = _objective_token_loss(logp, log_ratio, ratio, token_advantages, tokens, spec)
    weights = None
    if spec.behaviour_cap is not None:
        weights = _behaviour_weights(old_logp, behaviour_logp, tokens.valid, spec.behaviour_cap, compute_dtype)
        token_loss = torch.where(tokens.objective, token_loss * weights.capped, token_loss)
    if correction_weights is not None:
        token_loss = torch.where(tokens.objective, token_loss * correction_weights.detach().to(compute_dtype), token_loss)
    if spec.replay_loss == "shaped":
        shaped = _shaped_token_loss(logp, behaviour_logp, ratio, token_advantages, tokens.valid, spec, compute_dtype)
        token_loss = torch.where(tokens.shaped, shaped, token_loss)
    token_loss = token_loss.masked_fill(~tokens.valid, 0.0)

    totals = _checked_totals(totals, tokens.valid, spec)
    # A zero count means nothing is valid and the sum is exactly 0: dividing by 1 keeps the
    # loss 0.0 (not NaN) and its graph, so backward still runs.
    loss = _aggregate(token_loss, tokens.valid, spec) / max(totals.units, 1.0)
    kl = None
    if spec.kl_coef:
        kl = kl_penalty(logp, ref_logp, spec.kl_estimator, tokens.valid, compute_dtype)
        loss = loss + spec.kl_coef * _aggregate(kl, tokens.valid, spec) / max(totals.units, 1.0)
    if spec.entropy_coef:
        loss = loss - spec.entropy_coef * (entropy.to(compute_dtype) * tokens.valid).sum() / max(totals.tokens, 1.0)

    metrics = _loss_metrics(
        ratio=ratio.detach(),
        log_ratio=log_ratio.detach(),
        token_advantages=token_advantages,
        tokens=tokens,
        clip_active=clip_active,
        dual_active=dual_active,
        entropy=None if entropy is None else entropy.detach().to(compute_dtype),
        kl=None if kl is None else kl.detach(),
    )
    if weights is not None:
        _behaviour_metrics(weights, tokens.objective, spec.behaviour_cap, metrics)
    return loss, metrics


def _check_arguments(logp, old_logp, advantages, mask, spec, replay_mask, entropy, behaviour_logp,
                     correction_weights, ref_logp) -> None:
    """A wrong argument fails here, naming itself, before any arithmetic."""
    if not isinstance(spec, LossSpec):
        raise TypeError(f"spec must be a LossSpec, got {type(spec).__name__}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    batch_size = logp.shape[0]
    if spec.behaviour_cap is not None and behaviour_logp is None:
        raise ValueError("behaviour_logp is required when spec.behaviour_cap is set")
    if spec.kl_coef and ref_logp is None:
        raise ValueError("ref_logp (the reference policy's log-probs) is required when spec.kl_coef > 0")
    for name, tensor in (("old_logp", old_logp), ("mask", mask), ("entropy", entropy),
                         ("behaviour_logp", behaviour_logp), ("correction_weights", correction_weights),
                         ("ref_logp", ref_logp)):
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(tensor.shape)}")
    if advantages.shape not in (logp.shape, (batch_size,)):
        raise ValueError(
            f"advantages must be [B]={batch_size} or [B, T]={tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )
    if mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
        raise ValueError("mask must hold only 0 and 1 (it selects tokens; it does not weight them)")
    if replay_mask is not None and replay_mask.shape != (batch_size,):
        raise ValueError(f"replay_mask must be [B]={batch_size}, got {tuple(replay_mask.shape)}")
    if spec.entropy_coef:
        if entropy is None:
            raise ValueError("entropy is required when spec.entropy_coef > 0")
        if logp.requires_grad and not entropy.requires_grad:
            raise ValueError("entropy must carry gradients when spec.entropy_coef > 0 (compute it with autograd)")


@dataclass
class LossMetrics(Mapping[str, float]):
    """What one `policy_loss` call measured, each kept as what it is, so that micro-batches
    and ranks add up exactly (`rayrep.learner.sums.MetricSums.add_loss_metrics`): a mean as
    its (sum, count) over the tokens it is a mean of, an extreme by its direction, a count as
    a number. Read as a mapping, it gives this call's values: a mean over no token is 0.0
    (the ratio's and entropy's are absent then)."""

    means: dict[str, tuple[float, float]] = field(default_factory=dict)
    smallest: dict[str, float] = field(default_factory=dict)
    largest: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)

    def _values(self) -> dict[str, float]:
        values = {name: total / count if count else 0.0 for name, (total, count) in self.means.items()}
        return {**values, **self.smallest, **self.largest, **self.counts}

    def __getitem__(self, name: str) -> float:
        return self._values()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())


@dataclass(frozen=True)
class _TokenSets:
    """[B, T] bool masks: which valid tokens are fresh or replayed, and which objective each
    trains with."""

    valid: torch.Tensor
    fresh: torch.Tensor
    replay: torch.Tensor
    shaped: torch.Tensor
    """Replayed tokens under ExGRPO's shaping (none unless ``spec.replay_loss == "shaped"``)."""
    clipped: torch.Tensor
    """Tokens the clip and the dual clip apply to: replayed PPO tokens, and fresh ones when
    ``spec.clip_fresh``."""

    @property
    def objective(self) -> torch.Tensor:
        """Valid tokens under the policy objective (every valid token that is not shaped)."""
        return self.valid & ~self.shaped

    @classmethod
    def of(cls, mask: torch.Tensor, replay_mask: torch.Tensor | None, spec: LossSpec) -> _TokenSets:
        valid = mask.bool()
        none = torch.zeros_like(valid)
        replay_rows = none if replay_mask is None else replay_mask.bool().unsqueeze(-1).expand_as(valid)
        replay = valid & replay_rows
        fresh = valid & ~replay_rows
        shaped = replay if spec.replay_loss == "shaped" else none
        clipped = (replay & ~shaped) | (fresh if spec.clip_fresh else none)
        return cls(valid=valid, fresh=fresh, replay=replay, shaped=shaped, clipped=clipped)


def _clamped_log_ratio(new: torch.Tensor, old: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log(new / old) at valid tokens (0 elsewhere), clamped to +-LOG_RATIO_LIMIT. Padding may
    hold -inf or garbage: it is zeroed BEFORE exp, so that neither the forward value nor the
    backward pass (0 * inf = NaN) can see it."""
    log_ratio = torch.where(valid, new.to(dtype) - old.detach().to(dtype), 0.0)
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _clamped_ratio(logp, old_logp, valid, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(log r, r) with r = pi_theta / pi_old per token; r carries logp's gradient."""
    log_ratio = _clamped_log_ratio(logp, old_logp, valid, dtype)
    return log_ratio, log_ratio.exp()


def _token_advantages(advantages, valid, like: torch.Tensor, dtype) -> torch.Tensor:
    """[B, T] constant advantages (a [B] one broadcast over each row), 0 at invalid tokens."""
    token_advantages = advantages.detach().to(dtype)
    if token_advantages.dim() == 1:
        token_advantages = token_advantages.unsqueeze(-1).expand_as(like)
    return torch.where(valid, token_advantages, 0.0)


def _ppo_token_loss(ratio, token_advantages, tokens: _TokenSets, spec: LossSpec):
    """The PPO objective at every token, clipped (and dual-clipped) where ``tokens.clipped``:
    ``(loss, clip_active, dual_active)``, the two masks being where each bound is the active
    branch (zero gradient)."""
    unclipped_loss = -token_advantages * ratio
    clipped_loss = -token_advantages * ratio.clamp(1.0 - spec.clip_low, 1.0 + spec.clip_high)
    # The pessimistic (larger) of the two, selected with the same mask the clip fraction
    # reports, so the metric and the gradient can never disagree.
    clip_active = (clipped_loss > unclipped_loss) & tokens.clipped
    token_loss = torch.where(clip_active, clipped_loss, unclipped_loss)
    if spec.dual_clip is None:
        return token_loss, clip_active, torch.zeros_like(tokens.valid)
    dual_bound = -token_advantages * spec.dual_clip  # a constant: zero gradient once active
    dual_active = (token_advantages < 0) & (token_loss > dual_bound) & tokens.clipped
    return torch.where(dual_active, dual_bound, token_loss), clip_active, dual_active


def _objective_token_loss(logp, log_ratio, ratio, token_advantages, tokens: _TokenSets, spec: LossSpec):
    """``spec.objective`` at every token (the module's docstring): ``(loss, clip_active,
    dual_active)``, the masks being where a clip bound is the active branch (for CISPO: where
    the weight is clipped, its gradient kept) and where the dual clip is."""
    none = torch.zeros_like(tokens.valid)
    if spec.objective == "ppo":
        return _ppo_token_loss(ratio, token_advantages, tokens, spec)
    if spec.objective == "gspo":
        return _ppo_token_loss(_gspo_ratio(logp, log_ratio, tokens.objective), token_advantages, tokens, spec)
    if spec.objective == "cispo":
        weight = torch.where(tokens.clipped, ratio.clamp(1.0 - spec.clip_low, 1.0 + spec.clip_high), ratio)
        # Padding's log-prob may be -inf: zeroed, so that 0 * -inf cannot reach the sum.
        log_prob = torch.where(tokens.valid, logp.to(ratio.dtype), 0.0)
        return -weight.detach() * token_advantages * log_prob, (weight != ratio) & tokens.clipped, none
    tau = torch.where(token_advantages > 0, torch.full_like(ratio, spec.sapo_tau_pos),
                      torch.full_like(ratio, spec.sapo_tau_neg))
    return -token_advantages * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau), none, none


def _gspo_ratio(logp, log_ratio, objective_tokens) -> torch.Tensor:
    """[B, T] GSPO's per-token sequence ratio: the value of each row's geometric-mean ratio over
    its objective tokens, the gradient of that value times the token's own log-prob's."""
    count = objective_tokens.sum(-1).clamp(min=1)
    log_sequence = torch.where(objective_tokens, log_ratio, 0.0).sum(-1) / count
    log_prob = torch.where(objective_tokens, logp.to(log_ratio.dtype), 0.0)
    log_token = log_prob - log_prob.detach() + log_sequence.detach()[:, None]
    return log_token.clamp(max=GSPO_LOG_RATIO_CAP).exp()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, valid: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, T] a per-token estimate of KL(pi_theta || pi_ref) from the sampled tokens' log-probs,
    by verl's ``kl_penalty`` names (``d = logp - ref_logp``; the gradient flows through
    ``logp``), 0 where not `valid`:

    - ``k1`` / ``kl``: d; ``abs``: |d|; ``k2`` / ``mse``: d^2 / 2;
    - ``k3`` / ``low_var_kl``: exp(-d) + d - 1 with -d clamped to +-20 first and the result to
      +-`KL_CLAMP`;
    - a name with ``+``: the named estimate's value with k2's gradient (straight through), an
      unbiased gradient of the KL whatever value is logged."""
    base = estimator.removesuffix("+")
    valid = torch.ones_like(logp, dtype=torch.bool) if valid is None else valid
    # Padding may hold anything, -inf included: zeroed before any arithmetic sees it.
    d = torch.where(valid, logp.to(dtype), 0.0) - torch.where(valid, ref_logp.detach().to(dtype), 0.0)
    k2 = 0.5 * d.square()
    if base in ("k1", "kl"):
        value = d
    elif base == "abs":
        value = d.abs()
    elif base in ("k2", "mse"):
        value = k2
    elif base in ("k3", "low_var_kl"):
        reverse = (-d).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        value = (reverse.exp() - reverse - 1.0).clamp(-KL_CLAMP, KL_CLAMP)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    if estimator.endswith("+"):
        value = k2 - k2.detach() + value.detach()
    return value.masked_fill(~valid, 0.0)


@dataclass(frozen=True)
class _BehaviourWeights:
    raw: torch.Tensor
    """pi_prox / pi_behaviour per token (log clamped to +-LOG_RATIO_LIMIT)."""
    capped: torch.Tensor
    """The weight applied: ``min(raw, behaviour_cap)``."""


def _behaviour_weights(old_logp, behaviour_logp, valid, cap: float, dtype) -> _BehaviourWeights:
    """Decoupled PPO's importance weights. Constants: the correction weighs the gradient, it
    does not carry one."""
    raw = _clamped_log_ratio(old_logp.detach(), behaviour_logp, valid, dtype).exp()
    return _BehaviourWeights(raw=raw, capped=raw.clamp(max=cap))


def _shaped_token_loss(logp, behaviour_logp, ratio, token_advantages, valid, spec: LossSpec, dtype) -> torch.Tensor:
    """ExGRPO's ``-A * w / (w + beta)``, never clipped. ``w`` is the ratio to the recorded
    behaviour policy: ``old_logp`` holds it without decoupled PPO (so ``w = r``), and
    ``behaviour_logp`` with it."""
    w = ratio
    if spec.behaviour_cap is not None:
        w = _clamped_log_ratio(logp, behaviour_logp, valid, dtype).exp()
    return -token_advantages * (w / (w + spec.replay_beta))


def _aggregate(token_loss, valid, spec: LossSpec) -> torch.Tensor:
    """The sum ``spec.agg`` divides by the units of `Totals` (the module's docstring)."""
    if spec.agg == "token-mean":
        return token_loss.sum()
    if spec.agg == "seq-mean-token-sum-norm":
        return token_loss.sum() / spec.norm_constant
    sequence_sums = token_loss.sum(dim=-1)
    if spec.agg == "seq-mean-token-mean":
        # Empty sequences have a sum of 0, so clamping their count only avoids 0/0.
        return (sequence_sums / valid.sum(dim=-1).clamp(min=1)).sum()
    return (sequence_sums / spec.norm_constant).sum()


def _checked_totals(totals: Totals | None, valid, spec: LossSpec) -> Totals:
    """The mini-batch's counts, checked against this call's own; without them, this call's
    own (one micro-batch)."""
    local = _totals(valid.sum(-1), spec.agg, micro_batch_size=max(1, valid.shape[0]))
    if totals is None:
        return local
    if not (totals.units >= local.units and totals.tokens >= local.tokens):
        raise ValueError(
            f"totals ({totals}) must count the WHOLE mini-batch, at least this micro-batch's own {local} "
            f"for agg={spec.agg!r}"
        )
    return totals


def _behaviour_metrics(weights: _BehaviourWeights, ppo_tokens, cap: float, metrics: LossMetrics) -> None:
    """Adds ``behaviour_weight_mean`` (the weights applied) and ``behaviour_truncated_frac``
    (the share the cap cut), both over policy-objective tokens, and ``behaviour_weight_max``
    (before the cap), to `metrics`."""
    count = float(ppo_tokens.sum())
    metrics.means["behaviour_weight_mean"] = (float(weights.capped[ppo_tokens].sum()), count)
    metrics.means["behaviour_truncated_frac"] = (float((weights.raw[ppo_tokens] > cap).sum()), count)
    if count:
        metrics.largest["behaviour_weight_max"] = float(weights.raw[ppo_tokens].max())


@torch.no_grad()
def _loss_metrics(
    *,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    token_advantages: torch.Tensor,
    tokens: _TokenSets,
    clip_active: torch.Tensor,
    dual_active: torch.Tensor,
    entropy: torch.Tensor | None,
    kl: torch.Tensor | None = None,
) -> LossMetrics:
    """Diagnostics of one ``policy_loss`` call (all inputs [B, T]):

    * counts ``fresh_tokens``, ``replay_tokens``: valid tokens of each kind;
    * means, each over the tokens it names: ``fresh_clip_frac``, ``replay_clip_frac`` (that
      kind's tokens whose clip is active: the clipped branch with zero gradient, or CISPO's
      clipped weight, whose gradient stays; 0 for unclipped, SAPO's or shaped tokens),
      ``dual_clip_frac`` (valid tokens bounded by the dual clip),
      ``fresh_ratio_mean``, ``replay_ratio_mean`` (the ratio ``r``), ``fresh_entropy``,
      ``replay_entropy`` (when ``entropy`` is given), ``approx_kl`` (k3 estimate
      ``mean(r - 1 - log r)`` of KL(pi_old || pi_theta) over valid tokens),
      ``advantage_mean`` (per valid token), ``kl_ref`` (the KL penalty's estimate, when ``kl``
      is given);
    * extremes ``fresh_ratio_min``, ``fresh_ratio_max``, ``replay_ratio_min``, ``replay_ratio_max``.

    The ratio's and entropy's statistics of a kind without tokens are left out.
    """
    valid, fresh, replay = tokens.valid, tokens.fresh, tokens.replay
    means: dict[str, tuple[torch.Tensor, torch.Tensor]] = {  # name: (values, the tokens it is a mean over)
        "fresh_clip_frac": (clip_active, fresh),
        "replay_clip_frac": (clip_active, replay),
        "dual_clip_frac": (dual_active, valid),
        "approx_kl": (ratio - 1.0 - log_ratio, valid),
        "advantage_mean": (token_advantages, valid),
        "fresh_ratio_mean": (ratio, fresh),
        "replay_ratio_mean": (ratio, replay),
    }
    if entropy is not None:
        means.update(fresh_entropy=(entropy, fresh), replay_entropy=(entropy, replay))
    if kl is not None:
        means["kl_ref"] = (kl, valid)
    stats = []
    for values, selected in means.values():
        stats += [torch.where(selected, values.to(ratio.dtype), 0.0).sum(), selected.sum().to(ratio.dtype)]
    for selected in (fresh, replay):
        # The neutral element where unselected, instead of indexing with the mask, which
        # would force a device sync per call; empty sets are left out below.
        stats += [ratio.masked_fill(~selected, torch.inf).amin(), ratio.masked_fill(~selected, -torch.inf).amax()]
    host = torch.stack(stats).tolist()  # one device-to-host copy for all of them, not one sync per metric
    metrics = LossMetrics(means={name: (host[2 * i], host[2 * i + 1]) for i, name in enumerate(means)})
    extremes = host[2 * len(means):]
    for k, kind in enumerate(("fresh", "replay")):
        count = metrics.means[f"{kind}_ratio_mean"][1]
        metrics.counts[f"{kind}_tokens"] = count
        if count:
            metrics.smallest[f"{kind}_ratio_min"], metrics.largest[f"{kind}_ratio_max"] = extremes[2 * k: 2 * k + 2]
        else:
            for name in (f"{kind}_ratio_mean", f"{kind}_entropy"):
                metrics.means.pop(name, None)
    return metrics
