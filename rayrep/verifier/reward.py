"""Rewards: the verifier's verdict in the binary or DAPO style, plus DAPO's overlong shaping.

The one definition of a reward in rayrep: `Verdict.reward`, `score` and every algorithm's
scoring of its groups go through `correctness_reward` and `rewards`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["Style", "correctness_reward", "overlong_penalty", "rewards"]

Style = Literal["binary", "dapo"]
"""binary: 1 correct / 0 wrong; dapo: +1 / -1 (the DAPO and RLEP checkers)."""


def correctness_reward(correct: bool, style: Style = "binary") -> float:
    """The reward a verdict earns: 1.0 when correct, else 0.0 (binary) or -1.0 (dapo)."""
    if style not in ("binary", "dapo"):
        raise ValueError(f"style must be 'binary' or 'dapo', got {style!r}")
    if correct:
        return 1.0
    return -1.0 if style == "dapo" else 0.0


def rewards(
    correct: Sequence[bool],
    response_lengths: Sequence[int],
    *,
    style: Style,
    max_len: int,
    overlong_buffer: int,
    overlong_factor: float,
    scores: Sequence[float | None] | None = None,
) -> list[float]:
    """Each response's reward: its checker's score where `scores` has one, else its verdict
    in `style`; plus the overlong penalty when `overlong_factor` > 0 (see `overlong_penalty`)."""
    scores = scores if scores is not None else [None] * len(correct)
    base = [correctness_reward(ok, style) if score is None else float(score)
            for ok, score in zip(correct, scores, strict=True)]
    if not overlong_factor:
        return base
    penalty = overlong_penalty(list(response_lengths), max_len, overlong_buffer, overlong_factor)
    return [b + p for b, p in zip(base, penalty.tolist())]


def overlong_penalty(
    lengths: "torch.Tensor | np.ndarray | Sequence[float]",
    max_len: int,
    buffer_len: int,
    factor: float,
) -> "torch.Tensor":
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
    import torch  # here, not at the top: scripts that only score text never load torch

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

    lengths_t = lengths if isinstance(lengths, torch.Tensor) else torch.as_tensor(np.asarray(lengths))
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
