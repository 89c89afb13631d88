"""Group advantages and overlong shaping, against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayrep.algos.advantages import group_advantages
from rayrep.verifier.reward import overlong_penalty

EPS = 1e-6


def test_unequal_unsorted_groups_use_unbiased_std():
    # Three interleaved groups of sizes 3, 2, 4 with non-contiguous, unsorted, negative ids.
    group_index = [7, 2, -4, 7, 2, 7, -4, -4, -4]
    rewards = [1.0, 1.0, 2.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    # group 7:  rewards 1, 0, 0; mean 1/3; unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3
    std_7 = math.sqrt(1 / 3)
    # group 2:  rewards 1, -1; mean 0; unbiased var = (1 + 1) / 1 = 2
    std_2 = math.sqrt(2)
    # group -4: rewards 2, 0, 0, 0; mean 0.5; unbiased var = (2.25 + 3 * 0.25) / 3 = 1
    std_m4 = 1.0
    expected = [
        (2 / 3) / (std_7 + EPS),
        1 / (std_2 + EPS),
        1.5 / (std_m4 + EPS),
        (-1 / 3) / (std_7 + EPS),
        -1 / (std_2 + EPS),
        (-1 / 3) / (std_7 + EPS),
        -0.5 / (std_m4 + EPS),
        -0.5 / (std_m4 + EPS),
        -0.5 / (std_m4 + EPS),
    ]
    advantages = group_advantages(torch.tensor(rewards), torch.tensor(group_index))
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float32))


def test_rlep_group_sizes_18_17_16_and_order_invariance():
    # G = 16 fresh rollouts plus up to M = 2 replayed successes: a question with two,
    # one or no stored successes yields groups of 18, 17 and 16.
    fresh_correct = [4, 0, 16]
    replayed = [2, 1, 0]
    rewards, group_index = [], []
    for question, (correct, extra) in enumerate(zip(fresh_correct, replayed)):
        rewards += [1.0] * correct + [0.0] * (16 - correct) + [1.0] * extra
        group_index += [question] * (16 + extra)

    def binary_group_advantages(successes: int, size: int) -> tuple[float, float]:
        p = successes / size
        std = math.sqrt(size * p * (1 - p) / (size - 1))  # unbiased std of 0/1 rewards
        return (1 - p) / (std + EPS), -p / (std + EPS)

    expected = []
    for question, (correct, extra) in enumerate(zip(fresh_correct, replayed)):
        size, successes = 16 + extra, correct + extra
        if successes in (0, size):
            win = lose = 0.0
        else:
            win, lose = binary_group_advantages(successes, size)
        expected += [win] * correct + [lose] * (16 - correct) + [win] * extra
    expected = torch.tensor(expected, dtype=torch.float32)

    advantages = group_advantages(rewards, group_index)
    torch.testing.assert_close(advantages, expected)
    # Question 1 (1 replayed success among 17) must not be all zero: the replay is the
    # only signal there.
    assert (advantages[16:33] != 0).all()

    permutation = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(0))
    shuffled = group_advantages(
        torch.tensor(rewards)[permutation], torch.tensor(group_index)[permutation]
    )
    torch.testing.assert_close(shuffled, expected[permutation])


@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_all_equal_rewards_give_exact_zero(std_normalize, eps):
    # 0.1 is not representable: a naive mean leaves a residue that eps=0 would blow up.
    rewards = [0.1, 0.1, 0.1, -1.0, -1.0, 1.0, 0.0]
    group_index = [0, 0, 0, 1, 1, 2, 2]
    advantages = group_advantages(rewards, group_index, std_normalize=std_normalize, eps=eps)
    assert torch.equal(advantages[:5], torch.zeros(5))
    assert advantages[5] > 0 > advantages[6]


def test_size_one_groups_get_zero_not_nan():
    advantages = group_advantages([5.0, 1.0, 0.0, -3.0], [0, 1, 1, 2])
    assert torch.isfinite(advantages).all()
    assert advantages[0] == 0 and advantages[3] == 0
    expected = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(advantages[1:3], torch.tensor([expected, -expected]))


def test_dr_grpo_subtracts_the_mean_only():
    advantages = group_advantages([1.0, 0.0, 0.0, 3.0, 1.0], [4, 4, 4, 9, 9], std_normalize=False)
    torch.testing.assert_close(advantages, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0]))


def test_eps_is_added_to_the_std():
    advantages = group_advantages([1.0, 0.0], [0, 0], eps=1.0)
    expected = 0.5 / (math.sqrt(0.5) + 1.0)
    torch.testing.assert_close(advantages, torch.tensor([expected, -expected]))


def test_accepts_numpy_and_lists_and_keeps_float32():
    from_numpy = group_advantages(np.array([1.0, 0.0]), np.array([3, 3], dtype=np.int32))
    from_list = group_advantages([1, 0], [3, 3])
    from_tensor = group_advantages(
        torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([3, 3])
    )
    for advantages in (from_numpy, from_list, from_tensor):
        assert advantages.dtype == torch.float32
        torch.testing.assert_close(advantages, from_numpy)
    assert group_advantages([], []).shape == (0,)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="same length"):
        group_advantages([1.0, 0.0], [0])
    with pytest.raises(ValueError, match="group_index must hold integers"):
        group_advantages([1.0, 0.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_advantages([[1.0, 0.0]], [0, 0])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], [0, 0])
    with pytest.raises(ValueError, match="eps"):
        group_advantages([1.0, 0.0], [0, 0], eps=-1.0)


# ---- overlong penalty -------------------------------------------------------------


def test_overlong_ramp_paper_settings():
    # max 3072, buffer 512: the ramp starts at 2560.
    lengths = torch.tensor([0, 2559, 2560, 2561, 2816, 3071, 3072, 3073, 5000])
    expected = torch.tensor([0.0, 0.0, 0.0, -1 / 512, -0.5, -511 / 512, -1.0, -1.0, -1.0])
    penalty = overlong_penalty(lengths, max_len=3072, buffer_len=512, factor=1.0)
    assert penalty.dtype == torch.float32
    torch.testing.assert_close(penalty, expected)


def test_overlong_factor_scales_and_shape_is_kept():
    lengths = np.array([[8, 9], [10, 12]])
    penalty = overlong_penalty(lengths, max_len=10, buffer_len=2, factor=3.0)
    torch.testing.assert_close(penalty, torch.tensor([[0.0, -1.5], [-3.0, -3.0]]))


def test_overlong_zero_buffer_penalises_only_overruns():
    penalty = overlong_penalty([0, 3071, 3072, 3073], max_len=3072, buffer_len=0, factor=1.0)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, 0.0, -1.0]))


def test_overlong_buffer_equal_to_max_len_ramps_from_zero():
    penalty = overlong_penalty([0, 50, 100, 150], max_len=100, buffer_len=100, factor=1.0)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -0.5, -1.0, -1.0]))


def test_overlong_zero_factor_is_no_shaping():
    penalty = overlong_penalty([1, 100, 1000], max_len=100, buffer_len=10, factor=0.0)
    assert torch.equal(penalty, torch.zeros(3))


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(max_len=0, buffer_len=0, factor=1.0), "max_len"),
        (dict(max_len=100, buffer_len=-1, factor=1.0), "buffer_len"),
        (dict(max_len=100, buffer_len=101, factor=1.0), "buffer_len"),
        (dict(max_len=100, buffer_len=10, factor=-0.5), "factor"),
        (dict(max_len=100, buffer_len=10, factor=float("nan")), "factor"),
    ],
)
def test_overlong_validates_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        overlong_penalty([1, 2], **kwargs)


def test_overlong_rejects_negative_lengths():
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty([-1], max_len=100, buffer_len=10, factor=1.0)
