"""GRPO, RLEP and ExGRPO: rewards, group formation, replay bookkeeping (no actors needed)."""

import math

import numpy as np
import pytest
import torch

from rayrep.algos.exgrpo import ExGRPO, mean_token_entropy
from rayrep.algos.grpo import GRPO
from rayrep.algos.rlep import RLEP
from rayrep.buffer.files import BufferFileError, write_pool
from rayrep.buffer.shard import Answer
from rayrep.config import ConfigError, load_preset
from rayrep.types import Prompt, Rollout

PROMPT_IDS = [10, 11, 12]


def prompt(uid):
    return Prompt(uid, ({"role": "user", "content": uid},), "7")


def rollout(response, logprob=-0.5):
    return Rollout(PROMPT_IDS, list(response), [logprob] * len(response), "", "stop")


def base_cfg(**changes):
    defaults = {"replay.num_shards": 0, "algorithm.group_size": 4, "verifier.overlong_factor": 0.0}
    return load_preset("tiny-cpu").replace(**{**defaults, **changes})


# ---------------------------------------------------------------------- GRPO


def test_rewards_follow_the_style_and_overlong_shaping():
    cfg = base_cfg(**{"verifier.overlong_factor": 1.0, "verifier.overlong_buffer": 16,
                      "generator.max_response_tokens": 48})
    algo = GRPO(cfg)
    (group,) = algo.make_groups([prompt("q")], [[rollout([1] * 10), rollout([1] * 40), rollout([1] * 48)]], [[True, True, False]])
    algo.score([group])
    # 40 tokens: (40 - 32) / 16 = half the ramp; 48 tokens: the full penalty.
    assert group.rewards == pytest.approx([1.0, 1.0 - 0.5, -1.0 - 1.0])
    binary = GRPO(base_cfg(**{"verifier.reward_style": "binary"}))
    (group,) = binary.make_groups([prompt("q")], [[rollout([1]), rollout([1])]], [[True, False]])
    binary.score([group])
    assert group.rewards == [1.0, 0.0]


def test_grpo_batch_has_one_row_per_answer_with_group_advantages():
    algo = GRPO(base_cfg())
    groups = algo.make_groups([prompt("a"), prompt("b")], [[rollout([1, 2]), rollout([3])], [rollout([4]), rollout([5])]],
                              [[True, False], [False, False]])
    batch = algo.build_batch(groups)
    std = math.sqrt(2.0)  # unbiased std of (+1, -1)
    assert batch.advantages.tolist() == pytest.approx([1 / (std + 1e-6), -1 / (std + 1e-6), 0.0, 0.0], abs=1e-5)
    assert batch.prompt_index.tolist() == [0, 0, 1, 1]
    assert batch.response_mask.sum(1).tolist() == [2, 1, 1, 1]
    assert batch.recompute_old.all() and not batch.replay_mask.any()


# ---------------------------------------------------------------------- RLEP


@pytest.fixture
def pool_file(tmp_path):
    """q0: no successes stored; q1: one; q2: five."""
    def row(uid, response):
        return {"uid": uid, "prompt": prompt(uid).messages, "ground_truth": "7", "data_source": "t",
                "prompt_ids": PROMPT_IDS, "response_ids": response, "logprobs": [-0.25] * len(response),
                "text": "x", "reward": 1.0, "version": 3}
    rows = [row("q1", [50, 51])] + [row("q2", [60 + i, 1]) for i in range(5)]
    return write_pool(rows, tmp_path / "pool.parquet", source_checkpoint="ckpt")


def rlep(pool_file, **changes):
    cfg = base_cfg(**{"algorithm.name": "rlep", "algorithm.rlep.pool": str(pool_file),
                      "algorithm.rlep.replays_per_group": 2, **changes})
    algo = RLEP(cfg, {f"q{i}": PROMPT_IDS for i in range(3)})
    algo.attach(runtime=None)
    return algo


def test_rlep_adds_up_to_m_real_successes_never_placeholders(pool_file):
    algo = rlep(pool_file)
    prompts = [prompt(f"q{i}") for i in range(3)]
    fresh = [[rollout([1]) for _ in range(4)] for _ in prompts]
    groups = algo.make_groups(prompts, fresh, [[False] * 4 for _ in prompts])
    assert [g.size for g in groups] == [4, 5, 6]  # G + min(M, stored)
    assert [sum(g.replayed) for g in groups] == [0, 1, 2]
    assert groups[1].rollouts[4].response_ids == [50, 51]
    replayed_q2 = [tuple(r.response_ids) for r, rep in zip(groups[2].rollouts, groups[2].replayed) if rep]
    assert len(set(replayed_q2)) == 2 and all(ids[0] in range(60, 65) for ids in replayed_q2)
    for group in groups:  # replayed answers are the verified successes, with their recorded log-probs
        for r, rep, ok in zip(group.rollouts, group.replayed, group.correct):
            if rep:
                assert ok and r.logprobs == [-0.25] * len(r.response_ids) and r.version == 3
    batch = algo.build_batch(groups)
    # Advantages over all G' answers: q1 has 4 failures and 1 success.
    q1 = batch.advantages[batch.prompt_index == 1]
    rewards = torch.tensor([-1.0, -1, -1, -1, 1])
    assert q1.tolist() == pytest.approx(((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist(), abs=1e-5)
    assert batch.advantages[batch.prompt_index == 0].abs().max() == 0  # all fresh failures, nothing added
    metrics = algo.after_update(1, groups)
    assert metrics["replay_questions_short"] == 2 and metrics["replay_share"] == pytest.approx(3 / 15)


def test_rlep_old_logprob_modes(pool_file):
    prompts = [prompt("q2")]
    for mode, expected in (("recompute", [True] * 6), ("recorded", [True] * 4 + [False] * 2)):
        algo = rlep(pool_file, **{"algorithm.rlep.old_logprobs": mode})
        (group,) = algo.make_groups(prompts, [[rollout([1]) for _ in range(4)]], [[True, False, False, False]])
        assert algo.recompute_old(group) == expected


def test_rlep_optimizer_steps_do_not_depend_on_replays():
    from rayrep.runtime import optimizer_steps_per_rollout

    for m in (0, 2, 6):
        cfg = base_cfg(**{"algorithm.rlep.replays_per_group": m})
        assert optimizer_steps_per_rollout(cfg) == cfg.algorithm.prompts_per_step // cfg.learner.mini_batch_prompts


def test_rlep_rejects_pools_that_do_not_match(pool_file, tmp_path):
    with pytest.raises(ConfigError, match="algorithm.rlep.pool"):
        RLEP(base_cfg(**{"algorithm.name": "rlep"}), {})
    with pytest.raises(BufferFileError, match="other prompt tokens"):
        RLEP(base_cfg(**{"algorithm.rlep.pool": str(pool_file)}), {"q1": [1, 2, 3]})
    with pytest.raises(BufferFileError, match="none of its 2 questions"):
        RLEP(base_cfg(**{"algorithm.rlep.pool": str(pool_file)}), {"other": PROMPT_IDS})
    nan_pool = write_pool([{"uid": "q1", "prompt": prompt("q1").messages, "ground_truth": "7", "data_source": "t",
                            "prompt_ids": PROMPT_IDS, "response_ids": [5], "logprobs": [math.nan], "text": "",
                            "reward": 1.0}], tmp_path / "nan.parquet", "imported")
    with pytest.raises(ConfigError, match="use 'recompute'"):
        RLEP(base_cfg(**{"algorithm.rlep.pool": str(nan_pool), "algorithm.rlep.old_logprobs": "recorded"}), {"q1": PROMPT_IDS})


# ---------------------------------------------------------------------- ExGRPO


def exgrpo(**changes):
    cfg = base_cfg(**{"algorithm.name": "exgrpo", "algorithm.std_normalize": False, "algorithm.prompts_per_step": 8,
                      "learner.mini_batch_prompts": 8, **changes})
    algo = ExGRPO(cfg, [prompt(f"q{i}") for i in range(40)])
    # No learners: these tests keep replay_ratio at 0 where a batch would need the entropy
    # pass; tests/test_replay_runs.py runs ExGRPO with a real learner group.
    algo.attach(type("Runtime", (), {"learners": None})())
    return algo


def step(algo, step_number, marks_by_uid, start=0):
    """Plan, then pretend every question's fresh answers came back with the given marks."""
    plan = algo.plan_rollouts([prompt(f"q{i}") for i in range(start, start + 8)])
    prompts = [p for p, _ in plan]
    answers = [[rollout([100 + j, int(p.uid[1:]) % 7]) for j in range(n)] for p, n in plan]
    marks = [marks_by_uid(p.uid, n) for p, n in plan]
    groups = algo.make_groups(prompts, answers, marks)
    algo.build_batch(groups)
    return plan, groups, algo.after_update(step_number, groups)


def test_exgrpo_needs_the_mean_only_advantage():
    with pytest.raises(ConfigError, match="std_normalize must be false"):
        ExGRPO(base_cfg(**{"algorithm.name": "exgrpo"}), [])


def test_exgrpo_collects_nothing_before_the_pass_rate_switch():
    algo = exgrpo(**{"algorithm.exgrpo.replay_ratio": 0.0})
    _, _, metrics = step(algo, 1, lambda uid, n: [True] + [False] * (n - 1))  # pass rate 0.25 < 0.35
    assert metrics["exgrpo_collecting"] == 0.0 and algo.buffer.stats()["questions"] == 0
    # 0.5 > 0.35: the switch flips and this step's groups are stored.
    _, _, metrics = step(algo, 2, lambda uid, n: [True, True] + [False] * (n - 2))
    assert metrics["exgrpo_collecting"] == 1.0
    assert metrics["buffer_questions"] == 8 and metrics["buffer_answers"] == 8 * 2
    assert metrics["buffer_bucket_2"] == 8
    # One-way: a bad batch later does not switch it off.
    _, _, metrics = step(algo, 3, lambda uid, n: [False] * n, start=8)
    assert metrics["exgrpo_collecting"] == 1.0


def test_exgrpo_retires_all_correct_questions_and_dedups_answers():
    algo = exgrpo(**{"algorithm.exgrpo.start_pass_rate": 0.0, "algorithm.exgrpo.replay_ratio": 0.0})
    step(algo, 1, lambda uid, n: [True, True, False, False])
    assert algo.buffer.stats()["answers"] == 16
    # The same questions again: the same two correct answers (dedup by token ids) plus a new one.
    _, _, metrics = step(algo, 2, lambda uid, n: [True, True, True, False])
    assert metrics["buffer_stored"] == 8 and metrics["buffer_answers"] == 24 and metrics["buffer_bucket_3"] == 8
    # All K correct: retired, answers gone, never stored again.
    _, _, metrics = step(algo, 3, lambda uid, n: [True] * n)
    assert metrics["buffer_retired"] == 8 and metrics["buffer_questions"] == 0
    _, _, metrics = step(algo, 4, lambda uid, n: [True, False, False, False])
    assert metrics["buffer_questions"] == 0 and metrics["buffer_stored"] == 0


def test_mean_token_entropy_uses_each_rows_own_tokens():
    entropy = torch.tensor([[9.0, 1.0, 3.0, 0.0], [9.0, 9.0, 2.0, 4.0]])
    mask = torch.tensor([[False, True, True, False], [False, False, True, True]])
    assert mean_token_entropy(entropy, mask).tolist() == [2.0, 3.0]
