"""GRPO, RLEP and ExGRPO as step functions: plans, scoring, batches, replay bookkeeping,
dynamic sampling (no actors: an in-process replay buffer)."""

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from rayrep.algos.registry import check_inputs
from rayrep.algos.exgrpo import ExGRPO
from rayrep.algos.grpo import GRPO
from rayrep.algos.rlep import RLEP, load_pool
from rayrep.buffer.files import BufferFileError, write_pool
from rayrep.buffer.replay import ReplayBuffer
from rayrep.config import ConfigError, load_preset
from rayrep.data import PromptSampler
from rayrep.learner.forward import mini_batches
from rayrep.rollouts import keep_informative
from rayrep.types import Answer, Group, Prompt, Rollout, StepPlan, answer_arrays

PROMPT_IDS = [10, 11, 12]


def prompt(uid):
    return Prompt(uid, ({"role": "user", "content": uid},), "7")


def answer(response, logprob=-0.5):
    """An answer sampled here, its arrays here (its own `Rollout`)."""
    return Answer.of(Rollout(PROMPT_IDS, list(response), [logprob] * len(response), "", "stop"))


def fresh_group(p, responses, marks):
    return Group.sampled(p, [answer(r) for r in responses], marks)


def sampler_of(prompts) -> PromptSampler:
    return PromptSampler(list(prompts), seed=0)


def base_cfg(**changes):
    defaults = {"replay.num_shards": 0, "algorithm.group_size": 4, "verifier.overlong_factor": 0.0}
    return load_preset("tiny-cpu").replace(**{**defaults, **changes})


def roll_out(plan: StepPlan, marks_by_uid) -> list[Group]:
    """The generators' and verifiers' part of a round, by hand: `n` fresh rollouts per
    planned question with the given marks; then the plan's replays join their groups."""
    fresh = [fresh_group(p, [[100 + j, int(p.uid[1:]) % 7] for j in range(n)], marks_by_uid(p.uid, n))
             for p, n in plan.requests]
    return plan.complete(fresh)


# ---------------------------------------------------------------------- GRPO


def test_rewards_follow_the_style_and_overlong_shaping():
    cfg = base_cfg(**{"verifier.overlong_factor": 1.0, "verifier.overlong_buffer": 16,
                      "generator.max_response_tokens": 48})
    group = fresh_group(prompt("q"), [[1] * 10, [1] * 40, [1] * 48], [True, True, False])
    scored = GRPO(cfg).score(group)
    # 40 tokens: (40 - 32) / 16 = half the ramp; 48 tokens: the full penalty.
    assert scored.rewards == pytest.approx((1.0, 1.0 - 0.5, -1.0 - 1.0))
    assert group.rewards == ()  # a new value; the input is untouched
    binary = GRPO(base_cfg(**{"verifier.reward_style": "binary"}))
    assert binary.score(fresh_group(prompt("q"), [[1], [1]], [True, False])).rewards == (1.0, 0.0)


def test_grpo_batch_has_one_row_per_rollout_with_group_advantages():
    algo = GRPO(base_cfg())
    groups = [fresh_group(prompt("a"), [[1, 2], [3]], [True, False]), fresh_group(prompt("b"), [[4], [5]], [False, False])]
    step = algo.build(groups, step=3)
    batch = step.batch
    a, b = (order := [g.prompt.uid for g in step.groups]).index("a"), order.index("b")  # the groups, shuffled
    std = math.sqrt(2.0)  # unbiased std of (+1, -1)
    assert batch.advantages[batch.prompt_index == a].tolist() == pytest.approx([1 / (std + 1e-6), -1 / (std + 1e-6)])
    assert batch.advantages[batch.prompt_index == b].tolist() == [0.0, 0.0]
    assert sorted(batch.prompt_index.tolist()) == [0, 0, 1, 1]
    assert batch.response_mask[batch.prompt_index == a].sum(1).tolist() == [2, 1]
    first_a = int(torch.nonzero(batch.prompt_index == a)[0])
    assert batch.old_logprobs[first_a][batch.response_mask[first_a]].tolist() == [-0.5, -0.5]
    assert batch.recompute_old.all() and not batch.replay_mask.any()
    assert [step.groups[a].rewards, step.groups[b].rewards] == [(1.0, -1.0), (-1.0, -1.0)]
    assert step.metrics["groups_all_equal"] == 0.5 and step.metrics["reward_mean"] == -0.5
    assert step.loss == algo.loss and step.metrics["replay_share"] == 0


def test_no_mini_batch_is_all_replay_and_the_order_is_drawn_per_step():
    """The plans list replayed questions first (ExGRPO's 32 of 64 would be the whole first
    mini-batch); the batch is built in a seeded order per step with the replayed groups spread
    evenly, each group whole."""
    algo = GRPO(base_cfg(**{"algorithm.prompts_per_step": 8, "learner.mini_batch_prompts": 2}))
    replayed = [fresh_group(prompt(f"r{i}"), [[1], [2]], [True, False]).with_replays([answer([9])]) for i in range(4)]
    planned = replayed + [fresh_group(prompt(f"f{i}"), [[1], [2], [3]], [True, False, False]) for i in range(4)]
    orders = set()
    for step_number in range(40):
        built = algo.build(planned, step=step_number)
        batch, groups = built.batch, built.groups
        assert sorted(g.prompt.uid for g in groups) == sorted(g.prompt.uid for g in planned)
        for part in mini_batches(batch.num_prompts, 2):  # as the learner splits it
            in_part = (batch.prompt_index >= part.start) & (batch.prompt_index < part.stop)
            assert int(batch.replay_mask[in_part].sum()) == 1  # one replayed group of two, every time
        # Whole groups, each group's rows together and in the groups' order.
        assert batch.prompt_index.tolist() == [i for i, g in enumerate(groups) for _ in g.answers]
        assert batch.replay_mask.tolist() == [r for g in groups for r in g.replayed]
        orders.add(tuple(g.prompt.uid for g in groups))
    assert len(orders) > 30  # drawn anew each step ...
    # A batch that is not a multiple of the mini-batch size (a stale group dropped, refills
    # run out): its short last mini-batch is a fresh group.
    for step_number in range(10):
        built = algo.build(planned[:2] + planned[4:7], step=step_number)  # 2 replayed of 5
        assert [any(g.replayed) for g in built.groups] == [True, False, True, False, False]
    again = [g.prompt.uid for g in algo.build(planned, step=7).groups]
    assert again == [g.prompt.uid for g in GRPO(algo.cfg).build(planned, step=7).groups]  # ... the same on a resume
    other_seed = GRPO(algo.cfg.replace(**{"run.seed": 1}))
    assert any([g.prompt.uid for g in other_seed.build(planned, step=s).groups] !=
               [g.prompt.uid for g in algo.build(planned, step=s).groups] for s in range(3))


def test_grpo_plan_is_a_value_that_leaves_out_excluded_questions():
    algo = GRPO(base_cfg())
    sampler = sampler_of([prompt("a"), prompt("b"), prompt("c")])
    plan = algo.plan(sampler, 3, exclude=frozenset({"b"}))
    assert sorted((p.uid, n) for p, n in plan.requests) == [("a", 4), ("c", 4)]
    assert sampler.position == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.requests = ()
    with pytest.raises(ValueError, match="do not match the plan"):
        plan.complete([fresh_group(prompt("c"), [[1]], [True])])


def test_config_errors_of_the_loss_fail_when_the_algorithm_is_built():
    with pytest.raises(ConfigError, match="loss_norm_constant"):
        GRPO(base_cfg(**{"learner.loss_agg": "seq-mean-token-sum"}))


# ---------------------------------------------------------------------- dynamic sampling


def test_keep_informative_refills_with_other_questions_until_the_batch_is_full():
    asked, numbers = [], []

    def more(number, taken):
        asked.append(set(taken))
        numbers.append(number)
        n = len(asked)
        # each round brings one informative and one uninformative new question
        return [fresh_group(prompt(f"r{n}i"), [[1], [2]], [True, False]), fresh_group(prompt(f"r{n}u"), [[1], [2]], [True, True])]

    first = [fresh_group(prompt("a"), [[1], [2]], [False, False]), fresh_group(prompt("b"), [[1], [2]], [True, False])]
    kept, dropped, metrics = keep_informative(first, wanted=3, more=more)
    assert [g.prompt.uid for g in kept] == ["b", "r1i", "r2i"]
    assert sorted(g.prompt.uid for g in dropped) == ["a", "r1u", "r2u"]
    assert asked == [{"a", "b"}, {"a", "b", "r1i", "r1u"}]  # questions already in the step stay out
    assert numbers == [2, 3]  # the step's rounds, numbered from its first (what keys their seeds)
    assert metrics == {"dynamic_sampling_kept": 0.5, "dynamic_sampling_rounds": 2}
    # Gives up after max_rounds; surplus informative groups are verified, not trained.
    kept, dropped, metrics = keep_informative(first, wanted=10, more=more, max_rounds=1)
    assert len(kept) == 2 and metrics["dynamic_sampling_rounds"] == 1
    kept, dropped, _ = keep_informative(first + [fresh_group(prompt("c"), [[1], [2]], [False, True])], 1, more)
    assert [g.prompt.uid for g in kept] == ["b"] and "c" in [g.prompt.uid for g in dropped]


def test_a_replayed_success_makes_an_all_wrong_group_informative():
    group = fresh_group(prompt("q"), [[1], [2]], [False, False])
    assert not group.informative
    assert group.with_replays([answer([9])]).informative


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
    prompt_ids = {f"q{i}": PROMPT_IDS for i in range(3)}
    return RLEP(cfg, prompt_ids, load_pool(cfg, prompt_ids), ReplayBuffer(0, 64, seed=0))


def test_rlep_adds_up_to_m_real_successes_never_placeholders(pool_file):
    algo = rlep(pool_file)
    plan = algo.plan(sampler_of(prompt(f"q{i}") for i in range(3)), 3)
    assert [n for _, n in plan.requests] == [4, 4, 4]  # G fresh each; replays are drawn now
    groups = sorted(roll_out(plan, lambda uid, n: [False] * n), key=lambda g: g.prompt.uid)
    assert [g.size for g in groups] == [4, 5, 6]  # G + min(M, stored)
    assert [sum(g.replayed) for g in groups] == [0, 1, 2]
    # Replays are held by reference, their arrays left in the draw (`answer_arrays` reads them).
    [(_, response, _, _)] = answer_arrays([groups[1].answers[4]])
    assert response.tolist() == [50, 51]
    replayed_q2 = [tuple(response) for _, response, _, _ in answer_arrays(groups[2].replays())]
    assert len(set(replayed_q2)) == 2 and all(ids[0] in range(60, 65) for ids in replayed_q2)
    for group in groups:  # replayed rollouts are the verified successes; the learner recomputes their log-probs
        for a, (prompt_ids, response, logprobs, _) in zip(group.replays(), answer_arrays(group.replays())):
            assert a.correct and len(logprobs) == len(response) == a.length and np.isnan(logprobs).all()
            assert a.version == 3 and prompt_ids.tolist() == PROMPT_IDS
    step = algo.build(groups, step=1)
    position = {g.prompt.uid: i for i, g in enumerate(step.groups)}  # the batch's own order
    # Advantages over all G' rollouts: q1 has 4 failures and 1 success.
    q1 = step.batch.advantages[step.batch.prompt_index == position["q1"]]
    rewards = torch.tensor([-1.0, -1, -1, -1, 1])
    assert q1.tolist() == pytest.approx(((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist(), abs=1e-5)
    assert step.batch.advantages[step.batch.prompt_index == position["q0"]].abs().max() == 0  # all fresh failures
    assert step.metrics["replay_questions_short"] == 2 and step.metrics["replay_share"] == pytest.approx(3 / 15)
    assert step.metrics["replayed_questions"] == 2 and step.batch.replay_mask.sum() == 3


def test_rlep_old_logprob_modes(pool_file):
    """Replayed answers come with their recorded log-probs only where the learner reads them:
    as their old policy ('recorded') or as the behaviour policy of importance-corrected
    replay. A draw for 'recompute' leaves them behind (NaN, unknown), half the bytes."""
    for changes, expected, recorded in (
        ({"algorithm.rlep.old_logprobs": "recompute"}, [True] * 6, False),
        ({"algorithm.rlep.old_logprobs": "recorded"}, [True] * 4 + [False] * 2, True),
        ({"algorithm.rlep.old_logprobs": "recompute", "learner.behaviour_cap": 2.0}, [True] * 6, True),
    ):
        algo = rlep(pool_file, **changes)
        groups = roll_out(algo.plan(sampler_of([prompt("q2")]), 1), lambda uid, n: [True] + [False] * (n - 1))
        replayed = [logprobs for g in groups for _, _, logprobs, _ in answer_arrays(g.replays())]
        assert len(replayed) == 2
        if recorded:
            assert all(logprobs.tolist() == [-0.25] * 2 for logprobs in replayed), changes
        else:
            assert all(len(logprobs) == 2 and np.isnan(logprobs).all() for logprobs in replayed), changes
        step = algo.build(groups, step=1)
        assert step.batch.recompute_old.tolist() == expected


@pytest.mark.parametrize("replays", [0, 2, 6])
def test_rlep_optimizer_steps_do_not_depend_on_replays(pool_file, replays):
    """The learner's mini-batches are whole questions with all of their G + M rollouts, so
    RLEP takes as many optimizer steps per rollout as the baseline (the public code takes 9
    where the baseline takes 8)."""
    algo = rlep(pool_file, **{"algorithm.rlep.replays_per_group": replays, "algorithm.prompts_per_step": 6,
                              "learner.mini_batch_prompts": 2})
    sampler = sampler_of(prompt(f"q{i}") for i in range(3))  # 6 questions: two epochs of 3
    step = algo.build(roll_out(algo.plan(sampler, 6), lambda uid, n: [True, False] + [False] * (n - 2)), step=1)
    batch = step.batch
    steps = mini_batches(batch.num_prompts, algo.cfg.learner.mini_batch_prompts)
    assert len(steps) == 6 // 2
    rows_per_step = [int(((batch.prompt_index >= s.start) & (batch.prompt_index < s.stop)).sum()) for s in steps]
    assert sum(rows_per_step) == len(batch.prompt_index)  # every rollout, replays included, is trained
    assert rows_per_step == [step.groups[s.start].size + step.groups[s.start + 1].size for s in steps]


def test_rlep_rejects_pools_that_do_not_match(pool_file, tmp_path):
    with pytest.raises(ConfigError, match="algorithm.rlep.pool"):
        load_pool(base_cfg(**{"algorithm.name": "rlep"}), {})
    with pytest.raises(BufferFileError, match="other prompt tokens"):
        load_pool(base_cfg(**{"algorithm.rlep.pool": str(pool_file)}), {"q1": [1, 2, 3]})
    with pytest.raises(BufferFileError, match="none of its 2 questions"):
        load_pool(base_cfg(**{"algorithm.rlep.pool": str(pool_file)}), {"other": PROMPT_IDS})
    nan_pool = write_pool([{"uid": "q1", "prompt": prompt("q1").messages, "ground_truth": "7", "data_source": "t",
                            "prompt_ids": PROMPT_IDS, "response_ids": [5], "logprobs": [math.nan], "text": "",
                            "reward": 1.0}], tmp_path / "nan.parquet", "imported")
    with pytest.raises(ConfigError, match="use 'recompute'"):
        load_pool(base_cfg(**{"algorithm.rlep.pool": str(nan_pool), "algorithm.rlep.old_logprobs": "recorded"}),
                  {"q1": PROMPT_IDS})


def test_adaptive_replay_adds_stored_successes_only_to_groups_that_need_them(pool_file):
    """replay_if_at_most 1: q2's stored successes join its group when at most 1 of its 4
    fresh answers is right, and not when 2 are."""
    for right, replayed in ((0, 2), (1, 2), (2, 0), (4, 0)):
        algo = rlep(pool_file, **{"algorithm.rlep.replay_if_at_most": 1})
        plan = algo.plan(sampler_of([prompt("q2")]), 1)
        assert len(plan.replays["q2"]) == 2 and plan.replay_if_at_most == 1  # drawn before generation
        (group,) = roll_out(plan, lambda uid, n: [True] * right + [False] * (n - right))
        assert (group.size, sum(group.replayed)) == (4 + replayed, replayed)
        step = algo.build([group], step=1)
        assert step.batch.replay_mask.sum() == replayed and len(step.batch.prompt_index) == 4 + replayed
    always = rlep(pool_file)
    assert always.plan(sampler_of([prompt("q2")]), 1).replay_if_at_most is None  # the paper: always


def test_importance_corrected_replay_trains_replays_against_their_recorded_log_probs(pool_file):
    """learner.behaviour_cap: every row's old log-probs are recomputed (the proximal policy) and
    the recorded ones travel in the batch as the behaviour policy's, replays included."""
    algo = rlep(pool_file, **{"learner.behaviour_cap": 2.0})
    assert algo.loss.behaviour_cap == 2.0
    step = algo.build(roll_out(algo.plan(sampler_of([prompt("q2")]), 1), lambda uid, n: [True] + [False] * (n - 1)), step=1)
    batch = step.batch
    assert batch.replay_mask.tolist() == [False] * 4 + [True] * 2
    for row in range(6):
        recorded = -0.25 if batch.replay_mask[row] else -0.5  # the pool's, or the fresh rollouts'
        response = batch.response_mask[row]
        assert response.sum() == 2 and batch.old_logprobs[row][response].tolist() == [recorded] * 2
    assert step.loss.behaviour_cap == 2.0


def test_a_growing_pool_takes_each_steps_fresh_successes_once(pool_file):
    algo = rlep(pool_file, **{"algorithm.rlep.grow_pool": True})
    sampler = sampler_of([prompt("q0")])
    plan = algo.plan(sampler, 1)
    assert plan.replays == {}  # q0 has nothing stored
    step = algo.build(roll_out(plan, lambda uid, n: [True, True] + [False] * (n - 2)), step=1)
    metrics = algo.after_update(1, step)
    assert metrics["pool_stored"] == 2 and metrics["pool_questions"] == 3  # q1, q2 from the file, q0 now
    drawn = algo.plan(sampler, 1).replays["q0"]
    assert sorted(response.tolist() for _, response, _, _ in answer_arrays(drawn)) == [[100, 0], [101, 0]]
    assert all(r.version == 0 for r in drawn)
    # The same successes again, and the replayed ones: nothing new is stored.
    again = algo.build(roll_out(algo.plan(sampler, 1), lambda uid, n: [True, True] + [False] * (n - 2)), step=1)
    assert sum(again.groups[0].replayed) == 2 and algo.after_update(2, again)["pool_stored"] == 0
    fixed = rlep(pool_file)  # the paper's pool does not grow
    assert fixed.after_update(1, fixed.build(roll_out(fixed.plan(sampler, 1), lambda uid, n: [True] * n), step=1)) == {}


# ---------------------------------------------------------------------- ExGRPO


def exgrpo(**changes):
    cfg = base_cfg(**{"algorithm.name": "exgrpo", "algorithm.std_normalize": False, "algorithm.prompts_per_step": 8,
                      "learner.mini_batch_prompts": 8, **changes})
    prompts = [prompt(f"q{i}") for i in range(40)]
    # No learners: these tests do not join replays (the entropy pass);
    # tests/test_replay_runs.py runs ExGRPO with a real learner group. The training set: q0-q7.
    training_set = PromptSampler(prompts[:8], seed=0, keep_at_least=cfg.algorithm.prompts_per_step)  # as a run's
    return ExGRPO(cfg, prompts, {p.uid: PROMPT_IDS for p in prompts}, ReplayBuffer(0, 64, seed=0), learners=None,
                  sampler=training_set)


def step(algo, step_number, marks_by_uid, sampler=None):
    """Plan (from the run's training set unless another sampler is given), roll out by hand
    with the given marks, build, and remember."""
    plan = algo.plan(sampler or algo.sampler, 8)
    built = algo.build(roll_out(plan, marks_by_uid), step=step_number)
    return plan, built, algo.after_update(step_number, built)


def test_exgrpo_needs_the_mean_only_advantage():
    with pytest.raises(ConfigError, match="std_normalize must be false"):
        check_inputs(base_cfg(**{"algorithm.name": "exgrpo"}), [], {})


def test_exgrpo_collects_from_the_step_after_the_switch_and_replays_from_the_one_after():
    """As the public code: the step whose pass rate first exceeds the threshold flips the
    switch and stores nothing; the next collects; the one after is the first to replay."""
    algo = exgrpo(**{"algorithm.exgrpo.replay_ratio": 0.5, "algorithm.exgrpo.start_pass_rate": 0.35})  # the paper's
    _, _, metrics = step(algo, 1, lambda uid, n: [True] + [False] * (n - 1))  # pass rate 0.25 < 0.35
    assert metrics["exgrpo_collecting"] == 0.0 and metrics["buffer_questions"] == metrics["buffer_stored"] == 0
    # 0.5 > 0.35: the switch flips; this step's own groups are not stored.
    _, _, metrics = step(algo, 2, lambda uid, n: [True, True] + [False] * (n - 2))
    assert metrics["exgrpo_collecting"] == 1.0 and algo.buffer.stats()["questions"] == 0
    # The next step collects (and trains with the mixed loss) with nothing to replay yet.
    plan, built, metrics = step(algo, 3, lambda uid, n: [True, True] + [False] * (n - 2))
    assert plan.choose == () and all(n == 4 for _, n in plan.requests) and built.loss.replay_loss == "shaped"
    assert metrics["buffer_questions"] == 8 and metrics["buffer_answers"] == 8 * 2
    assert metrics["buffer_bucket_2"] == 8
    # The one after replays: half its questions come from the buffer, with K - 1 fresh rollouts.
    plan = algo.plan(sampler_of(prompt(f"q{i}") for i in range(8, 16)), 8)
    assert len(plan.choose) == 4 and sorted(n for _, n in plan.requests) == [3] * 4 + [4] * 4
    # One-way: a bad batch later does not switch it off.
    _, _, metrics = step(algo, 4, lambda uid, n: [False] * n, sampler=sampler_of(prompt(f"q{i}") for i in range(8, 16)))
    assert metrics["exgrpo_collecting"] == 1.0


def test_exgrpo_retires_all_correct_questions_and_dedups_answers():
    algo = exgrpo(**{"algorithm.exgrpo.start_pass_rate": 0.0, "algorithm.exgrpo.replay_ratio": 0.0})
    step(algo, 1, lambda uid, n: [True, True, False, False])  # flips the switch, stores nothing
    step(algo, 2, lambda uid, n: [True, True, False, False])
    assert algo.buffer.stats()["answers"] == 16
    # The same questions again: the same two correct answers (dedup by token ids) plus a new one.
    _, _, metrics = step(algo, 3, lambda uid, n: [True, True, True, False])
    assert metrics["buffer_stored"] == 8 and metrics["buffer_answers"] == 24 and metrics["buffer_bucket_3"] == 8
    # All K correct: retired, answers gone, never stored again.
    _, _, metrics = step(algo, 4, lambda uid, n: [True] * n)
    assert metrics["buffer_retired"] == 8 and metrics["buffer_questions"] == 0
    _, _, metrics = step(algo, 5, lambda uid, n: [True, False, False, False])
    assert metrics["buffer_questions"] == 0 and metrics["buffer_stored"] == 0


def test_a_retired_question_leaves_the_training_set_at_the_next_epoch_in_both_phases():
    """The public code's scope (the default): an all-correct question is retired at every
    step, before the switch too, and is not drawn again as fresh once the epoch under way
    ends; `retire_from: buffer` (rayrep's earlier behaviour) retires it from the buffer only,
    and only once collecting."""
    algo = exgrpo(**{"algorithm.prompts_per_step": 2, "learner.mini_batch_prompts": 2,
                     "algorithm.exgrpo.replay_ratio": 0.0, "algorithm.exgrpo.start_pass_rate": 0.9})
    sampler = algo.sampler  # q0-q7, 4 steps of 2 an epoch
    plan = algo.plan(sampler, 2)
    first = [p.uid for p, _ in plan.requests]
    built = algo.build(roll_out(plan, lambda uid, n: [True] * n if uid == first[0] else [True, False, False, False]),
                       step=1)
    metrics = algo.after_update(1, built)  # pass rate 5/8 < 0.9: before the switch
    assert metrics["exgrpo_collecting"] == 0.0 and metrics["buffer_retired"] == 1 and sampler.retired == {first[0]}
    rest_of_epoch = [p.uid for p in sampler.next(6)]
    assert metrics["exgrpo_epoch_questions"] == 8 and sorted(first + rest_of_epoch) == [f"q{i}" for i in range(8)]
    later = [p.uid for p in sampler.next(7 * 5)]  # five epochs of the seven left
    assert first[0] not in later and sorted(set(later)) == sorted(set(rest_of_epoch + first[1:]))
    assert sampler.active == 7
    # Retired in the middle of an epoch: still drawn in it, and a resumed run's sampler goes
    # on with the same draws (the epoch's order keeps what it kept when it began).
    sampler.next(3)
    upcoming = copy.deepcopy(sampler).next(1)[0].uid
    sampler.retire([upcoming])
    resumed = PromptSampler(list(sampler.prompts), seed=0, keep_at_least=2)
    resumed.restore(json.loads(json.dumps(sampler.state())))
    draws = [p.uid for p in sampler.next(20)]
    assert [p.uid for p in resumed.next(20)] == draws
    assert draws[0] == upcoming and upcoming not in draws[4:] and first[0] not in draws  # 4: the epoch's rest

    old = exgrpo(**{"algorithm.exgrpo.retire_from": "buffer", "algorithm.exgrpo.replay_ratio": 0.0,
                    "algorithm.exgrpo.start_pass_rate": 0.9})
    _, _, metrics = step(old, 1, lambda uid, n: [True] * n if uid == "q0" else [False] * n)
    assert old.sampler.retired == set() and "buffer_retired" not in metrics  # before the switch: nothing
    old.collecting = True
    _, _, metrics = step(old, 2, lambda uid, n: [True] * n if uid == "q0" else [True, False, False, False])
    assert metrics["buffer_retired"] == 1 and old.sampler.retired == set()
    assert "q0" in [p.uid for p in old.sampler.next(8 * 3)]  # still drawn as fresh


def test_the_training_set_stops_shrinking_at_one_batch():
    sampler = PromptSampler([prompt(f"q{i}") for i in range(6)], seed=3, keep_at_least=4)
    sampler.next(6)
    sampler.retire(["q0", "q1"])
    assert sorted(p.uid for p in sampler.next(4)) == ["q2", "q3", "q4", "q5"]  # 4 left: enough for a batch
    sampler.next(4)
    sampler.retire(["q2"])  # 3 would be left: the set stays at the 4
    assert sorted(p.uid for p in sampler.next(4)) == ["q2", "q3", "q4", "q5"]


def test_exgrpo_bookkeeping_sees_groups_that_dynamic_sampling_dropped():
    algo = exgrpo(**{"algorithm.exgrpo.start_pass_rate": 0.0, "algorithm.exgrpo.replay_ratio": 0.0})
    step(algo, 1, lambda uid, n: [True, False, False, False])  # flips the switch
    plan = algo.plan(algo.sampler, 8)
    groups = roll_out(plan, lambda uid, n: [True] * n if uid in ("q0", "q1") else [True, False, False, False])
    kept, dropped, _ = keep_informative(groups, 8, more=lambda number, taken: [])
    built = algo.build(kept, dropped, step=2)
    assert len(built.groups) == 6 and len(built.dropped) == 2
    metrics = algo.after_update(2, built)
    assert metrics["buffer_retired"] == 2 and metrics["buffer_questions"] == 6  # the all-correct ones retire
    assert algo.sampler.retired == {"q0", "q1"}


def test_exgrpo_switches_to_the_mixed_policy_loss_for_good_once_collection_starts():
    algo = exgrpo(**{"algorithm.exgrpo.replay_ratio": 0.0})
    fresh = [fresh_group(prompt("q0"), [[1], [2]], [True, False])]
    assert algo.build(fresh, step=1).loss == algo.loss  # before collection: the clipped PPO loss
    step(algo, 1, lambda uid, n: [True, True] + [False] * (n - 2))  # pass rate 0.5: collection starts
    # From then on every step trains with the mixed loss, with or without replayed questions.
    for groups in (fresh, [fresh[0].with_replays([answer([3])])]):
        mixed = algo.build(groups, step=1)
        assert (mixed.loss.replay_loss, mixed.loss.clip_fresh, mixed.loss.replay_beta) == ("shaped", False, 0.1)
    assert mixed.batch.recompute_old.tolist() == [True, True, False]  # w = pi_theta / pi_recorded
    paper = exgrpo(**{"algorithm.exgrpo.clip_fresh_in_mixed": True, "algorithm.exgrpo.replay_ratio": 0.0})
    step(paper, 1, lambda uid, n: [True] * (n - 1) + [False])
    assert paper.build(fresh, step=1).loss.clip_fresh is True


def test_the_registry_is_the_one_place_that_knows_the_algorithms_by_name():
    """`algorithm.name`'s choices are the registry's; each class says what the run needs of it
    (RLEP: a buffer, and its pool read before any actor starts, unless a shared pool replaces
    it); and nothing outside `rayrep/algos/` compares an algorithm's name with a string."""
    import ast
    import typing
    from pathlib import Path

    from rayrep.algos.registry import ALGORITHMS, algorithm_class
    from rayrep.config.schema import AlgorithmConfig

    assert set(typing.get_args(typing.get_type_hints(AlgorithmConfig)["name"])) == set(ALGORITHMS)
    assert {name: (cls.replays, cls.pool_from_baseline) for name, cls in ALGORITHMS.items()} == {
        "grpo": (False, False), "rlep": (True, True), "exgrpo": (True, False), "prioritized": (True, False)}
    assert algorithm_class(base_cfg(**{"algorithm.name": "rlep"})) is RLEP
    with pytest.raises(ConfigError, match="algorithm.rlep.pool: RLEP needs an experience pool"):
        check_inputs(base_cfg(**{"algorithm.name": "rlep"}), [], {})
    assert check_inputs(base_cfg(**{"algorithm.name": "rlep", "replay.pool": "shared"}), [], {}).pool is None
    with pytest.raises(ConfigError, match="algorithm.prioritized.correction='decoupled' weighs every token"):
        check_inputs(base_cfg(**{"algorithm.name": "prioritized", "learner.correction.weights": "token"}), [], {})

    package = Path(__file__).resolve().parents[1] / "rayrep"
    names = set(ALGORITHMS)
    for path in package.rglob("*.py"):
        if path.parent.name == "algos":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                strings = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                assert not names & set(strings), f"{path.relative_to(package)}:{node.lineno} compares with {strings}"
