"""Group-relative advantages, shared by every algorithm (grpo, rlep, exgrpo).

Pure tensor code: it runs in the driver on one step's rewards, before the batch goes to
the learners. The rewards themselves come from `rayrep.verifier.reward`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["group_advantages"]

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
