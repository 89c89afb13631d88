"""Group-relative advantages and DAPO's overlong reward shaping.

Both functions are pure tensor code shared by every algorithm (grpo, rlep, exgrpo):
they run in the driver on one step's rewards, before the batch goes to the learners.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["group_advantages", "overlong_penalty"]

TensorLike = torch.Tensor | np.ndarray | Sequence[float]


def _as_1d_tensor(values: TensorLike, name: str) -> torch.Tensor:
    tensor = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor


def group_advantages(
    rewards: TensorLike,
    group_index: TensorLike,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: each reward standardised within its question's group.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` where ``g`` is sample i's group, ``mean_g``
    its mean and ``std_g`` its *unbiased* (n - 1) standard deviation, as the RLEP code
    computes it. With ``std_normalize=False`` the advantage is ``r_i - mean_g`` (the
    Dr.GRPO / ExGRPO form).

    Groups mix fresh rollouts and replayed answers, so their sizes differ from question
    to question (18, 17, 16 when a question has fewer stored successes than requested)
    and their members need not be adjacent: the statistics are computed per group id,
    whatever the order.

    A group with a single member, or whose rewards are all equal, carries no learning
    signal: its advantages are exactly 0 (never NaN, never a tiny float residue).

    Args:
        rewards: [N] float rewards, one per sample (tensor, numpy array or list).
        group_index: [N] integer group id of each sample (any integers, e.g. one id per
            question; need not be contiguous, sorted or start at 0).
        std_normalize: divide by the group's standard deviation (GRPO/DAPO) or not
            (Dr.GRPO/ExGRPO).
        eps: added to the standard deviation; keeps groups with a tiny spread finite.

    Returns:
        [N] float32 advantages, on ``rewards``' device when it is a tensor.

    Raises:
        ValueError: shapes differ or are not 1-D, ``group_index`` is not integer,
            a reward is not finite, or ``eps`` is negative.
    """
    rewards_t = _as_1d_tensor(rewards, "rewards")
    group_t = _as_1d_tensor(group_index, "group_index")
    if rewards_t.shape != group_t.shape:
        raise ValueError(
            f"rewards and group_index must have the same length, "
            f"got {rewards_t.shape[0]} and {group_t.shape[0]}"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rewards_t.numel() == 0:
        # An empty list arrives as float64 from numpy: nothing to check, nothing to do.
        return torch.zeros(0, dtype=torch.float32, device=rewards_t.device)
    if group_t.dtype == torch.bool or group_t.dtype.is_floating_point or group_t.is_complex():
        raise ValueError(f"group_index must hold integers, got dtype {group_t.dtype}")

    device = rewards_t.device
    # float64 so that a group mean of equal rewards reproduces them closely; the exact
    # zero for such groups is enforced below anyway.
    rewards_t = rewards_t.to(device=device, dtype=torch.float64)
    if not torch.isfinite(rewards_t).all():
        raise ValueError("rewards must be finite (a NaN or inf would poison its whole group)")

    _, group_of_sample = torch.unique(group_t.to(device), return_inverse=True)
    num_groups = int(group_of_sample.max()) + 1

    def per_group_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=values.dtype, device=device).index_add_(
            0, group_of_sample, values
        )

    group_size = per_group_sum(torch.ones_like(rewards_t))
    group_mean = per_group_sum(rewards_t) / group_size
    deviation = rewards_t - group_mean[group_of_sample]

    # Equal rewards can leave a rounding residue in `deviation`; with std ~ 1e-17 and
    # eps = 1e-6 it would be negligible, but with std_normalize=False or eps=0 it
    # would not be. Comparing min and max makes "no signal" exactly 0.
    group_max = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=device)
    group_min = torch.full((num_groups,), math.inf, dtype=torch.float64, device=device)
    group_max = group_max.scatter_reduce(0, group_of_sample, rewards_t, reduce="amax")
    group_min = group_min.scatter_reduce(0, group_of_sample, rewards_t, reduce="amin")
    has_spread = (group_max > group_min)[group_of_sample]
    # A size-1 group has max == min, so it is covered by the same rule.

    if std_normalize:
        # Unbiased variance; clamp the n - 1 divisor so size-1 groups (masked out above)
        # do not produce 0 / 0.
        squared_deviation_sum = per_group_sum(deviation * deviation)
        group_std = (squared_deviation_sum / (group_size - 1).clamp(min=1)).sqrt()
        advantages = deviation / (group_std[group_of_sample] + eps)
    else:
        advantages = deviation

    advantages = torch.where(has_spread, advantages, torch.zeros_like(advantages))
    return advantages.to(torch.float32)


def overlong_penalty(
    lengths: TensorLike,
    max_len: int,
    buffer_len: int,
    factor: float,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, a reward term added to the verifier's score.

    With ``soft_start = max_len - buffer_len``::

        length <= soft_start            ->  0
        soft_start < length <= max_len  ->  -factor * (length - soft_start) / buffer_len
        length > max_len                ->  -factor

    so the penalty ramps linearly from 0 at ``soft_start`` to ``-factor`` at ``max_len``
    (paper: max_len 3072, buffer_len 512, factor 1.0).

    ``buffer_len == 0`` is the limit of the ramp as the buffer shrinks: no penalty up to
    and including ``max_len``, ``-factor`` beyond it (a hard penalty for responses that
    overrun; a generator that truncates at ``max_len`` never triggers it). Use
    ``factor = 0`` to turn shaping off altogether.

    Args:
        lengths: response lengths in tokens, any shape (tensor, numpy array or list);
            integer or float, non-negative.
        max_len: maximum response length, > 0.
        buffer_len: length of the ramp, in [0, max_len].
        factor: magnitude of the full penalty, finite and >= 0.

    Returns:
        float32 penalties (<= 0) with the shape of ``lengths``, on its device when it is
        a tensor.

    Raises:
        ValueError: an argument is out of range (the message names it).
    """
    if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len <= 0:
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
    if (
        isinstance(buffer_len, bool)
        or not isinstance(buffer_len, numbers.Integral)
        or not 0 <= buffer_len <= max_len
    ):
        raise ValueError(
            f"buffer_len must be an integer in [0, max_len={max_len}], got {buffer_len!r}"
        )
    if not (isinstance(factor, numbers.Real) and math.isfinite(factor) and factor >= 0):
        raise ValueError(f"factor must be a finite number >= 0, got {factor!r}")

    lengths_t = (
        lengths if isinstance(lengths, torch.Tensor) else torch.as_tensor(np.asarray(lengths))
    )
    if lengths_t.dtype == torch.bool or lengths_t.is_complex():
        raise ValueError(f"lengths must be integer or float, got dtype {lengths_t.dtype}")
    lengths_t = lengths_t.to(torch.float64)
    if lengths_t.numel() and not (lengths_t >= 0).all():
        raise ValueError("lengths must be >= 0 (and not NaN)")

    soft_start = max_len - buffer_len
    if buffer_len > 0:
        overrun = (lengths_t - soft_start).clamp(min=0.0, max=float(buffer_len))
        # `+ 0.0` turns the -0.0 of unpenalised lengths into 0.0 for clean logs.
        penalty = -factor * overrun / buffer_len + 0.0
    else:
        penalty = torch.zeros_like(lengths_t)
    # Beyond max_len the ramp is saturated already when buffer_len > 0; this line is what
    # penalises overruns when buffer_len == 0.
    penalty = torch.where(lengths_t > max_len, torch.full_like(penalty, -float(factor)), penalty)
    return penalty.to(torch.float32)
