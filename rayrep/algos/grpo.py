"""GRPO / DAPO, the baseline every replay method builds on, and DAPO's dynamic sampling.

The RLEP paper's baseline "DAPO-nodyn-bs64": group-normalised advantages, token-mean
loss, clip-higher (0.2 / 0.28) with dual clip, overlong reward shaping, no KL, no entropy
bonus; dynamic sampling is an option (off).

GRPO implements `rayrep.algos.interface.Algorithm` and trains on fresh groups only; RLEP
and ExGRPO (rlep.py, exgrpo.py) override what they change. DAPO's dynamic sampling is a
matter of rounds: `rayrep.rollouts.keep_informative`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

from rayrep.algos.advantages import group_advantages
from rayrep.algos.interface import AlgorithmInputs
from rayrep.buffer.answers import DrawLimit, Origin
from rayrep.config import Config, derive_seed
from rayrep.data import PromptSampler
from rayrep.types import BatchRecipe, BatchRow, Group, LossSpec, StepBatch, StepPlan
from rayrep.verifier.reward import rewards

if TYPE_CHECKING:
    from rayrep.buffer.replay import ReplayStore
    from rayrep.learner.group import LearnerGroup


class GRPO:
    name: ClassVar[str] = "grpo"
    label: ClassVar[str] = "GRPO/DAPO"
    replays: ClassVar[bool] = False
    settings: ClassVar[dict[str, object]] = {}
    """What choosing this algorithm sets (`section.field` -> value) over a preset's values,
    unless the user's command line or config file sets it (`rayrep.cli`)."""
    """Whether the run keeps a replay buffer (its shards are placed and started with the other roles)."""
    pool_from_baseline: ClassVar[bool] = False
    """Whether the comparison pipeline samples an experience pool from the baseline's final
    checkpoint before this algorithm trains (RLEP's phase 1)."""
    replay_old_logprobs: Literal["recompute", "recorded"] = "recompute"
    """Replayed rollouts' old log-probs: recomputed by the learner (ratio starts at 1) or the
    recorded behaviour ones. Fresh rollouts are always recomputed."""

    def __init__(self, cfg: Config, origin: Origin = Origin(), learners: LearnerGroup | None = None):
        """`origin`: the run and checkpoint that sample its answers (what the answers it
        stores in a replay buffer carry); `learners`: where the passes it asks for run (the KL
        in the reward; ExGRPO's entropy choice), None where none does."""
        self.cfg = cfg
        self.origin = origin
        self.learners = learners
        self.loss = cfg.learner.loss_spec()

    @classmethod
    def check_inputs(cls, cfg: Config, inputs: AlgorithmInputs) -> AlgorithmInputs:
        """What can be wrong with this algorithm's inputs, checked (and what it reads, read)
        before any actor starts: an InputError or ConfigError naming it."""
        return inputs

    @classmethod
    def create(cls, cfg: Config, inputs: AlgorithmInputs, buffer: ReplayStore | None, learners: LearnerGroup | None,
               sampler: PromptSampler) -> GRPO:
        """The algorithm, whole, with the run's replay buffer, learners and training set."""
        return cls(cfg, inputs.origin, learners)

    def state(self) -> dict:
        """What a resumed run needs of the algorithm besides the buffer (JSON values)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Continue from `state()` of a checkpoint."""

    # ------------------------------------------------------------------ the step

    def plan(self, sampler: PromptSampler, questions: int, exclude: frozenset[str] = frozenset(),
             version: int = 0) -> StepPlan:
        """`questions` fresh questions from the sampler with G rollouts each, leaving out those
        in `exclude` (questions already in this step). `version`: the policy version that
        samples them (what a replay method's draw limit counts from)."""
        group_size = self.cfg.algorithm.group_size
        return StepPlan(tuple((p, group_size) for p in sampler.next(questions) if p.uid not in exclude))

    def draw_limit(self, version: int) -> DrawLimit | None:
        """Which stored answers a replay method may draw at policy version `version`
        (`replay.max_version_lag`, `replay.others_only`); None: any."""
        replay = self.cfg.replay
        limit = DrawLimit(version, replay.max_version_lag, self.origin.run, replay.others_only)
        return limit if limit.limits else None

    def join_replays(self, groups: Sequence[Group]) -> tuple[list[Group], dict[str, float]]:
        """The groups with the stored answers the plan left to choose (`StepPlan.choose`),
        chosen now that the learners hold the GPUs; and what choosing measured. GRPO and
        RLEP plan theirs whole: nothing to choose."""
        return list(groups), {}

    def build(self, groups: Sequence[Group], dropped: Sequence[Group] = (), *, step: int) -> StepBatch:
        """Score the groups, take advantages over each whole group (fresh and replayed
        rollouts together), and write the learners' batch (`BatchRecipe`: its rows by
        reference), its questions in an order drawn for `step` (`mini_batch_order`).
        `dropped`: groups verified but not trained on (dynamic sampling), scored for the record."""
        ordered = mini_batch_order(groups, self.cfg.seed("data"), step)
        penalties, penalty_metrics = self.kl_penalties(ordered)
        trained = [self.score(g, p) for g, p in zip(ordered, penalties)]
        left_out = [self.score(g) for g in dropped]
        algo = self.cfg.algorithm
        index = [i for i, g in enumerate(trained) for _ in g.answers]
        advantages = group_advantages(
            [r for g in trained for r in g.rewards], index, std_normalize=algo.std_normalize, eps=algo.advantage_eps
        )
        rows = [answer for g in trained for answer in g.answers]
        recompute_replays = self.replay_old_logprobs == "recompute"
        # The rows by reference: the learners read their arrays where the generators and the
        # buffer shards left them (`BatchRecipe.collate`).
        recipe = BatchRecipe(
            tuple(BatchRow(a._replace(advantage=advantage), question, recompute_replays or not a.replayed)
                  for a, question, advantage in zip(rows, index, advantages.tolist())),
            temperature=self.cfg.generator.temperature)
        return StepBatch(recipe, self.loss_spec(trained), tuple(trained), tuple(left_out),
                         {**self.step_metrics(trained, left_out), **penalty_metrics})

    def after_update(self, step: int, batch: StepBatch) -> dict[str, float]:
        return {}

    # ------------------------------------------------------------------ parts of build

    def score(self, group: Group, penalties: Sequence[float] | None = None) -> Group:
        """The group with its rewards: the checker's score, or the verdict (+1/-1 or 1/0), plus
        DAPO's overlong shaping, less each answer's KL penalty where it has one."""
        verifier = self.cfg.verifier
        values = rewards(
            group.correct, [a.length for a in group.answers], style=verifier.reward_style,
            max_len=self.cfg.generator.max_response_tokens, overlong_buffer=verifier.overlong_buffer,
            overlong_factor=verifier.overlong_factor, scores=group.scores,
        )
        if penalties is not None:
            values = [value - penalty for value, penalty in zip(values, penalties)]
        return group.with_rewards(values)

    def kl_penalties(self, groups: Sequence[Group]) -> tuple[list[list[float] | None], dict[str, float]]:
        """The KL in the reward (`learner.kl.in_reward`, verl's `use_kl_in_reward`): per group,
        each answer's coef x the sum over its tokens of the KL estimate between the policy the
        update starts from and the reference (the learners' two passes without a graph), and the
        step's `kl_ref` (its token mean) and `kl_reward_penalty` (the mean penalty per answer);
        None for every group without it."""
        kl = self.cfg.learner.kl
        if not (kl.coef and kl.in_reward):
            return [None] * len(groups), {}
        start = time.perf_counter()
        rows = tuple(BatchRow(answer._replace(advantage=0.0), question, True)  # (advantages come after)
                     for question, g in enumerate(groups) for answer in g.answers)
        sums, tokens = self.learners.kl_to_reference(BatchRecipe(rows, temperature=self.cfg.generator.temperature),
                                                     kl.estimator)
        penalties = (kl.coef * sums).tolist()
        per_group, at = [], 0
        for g in groups:
            per_group.append(penalties[at : at + len(g.answers)])
            at += len(g.answers)
        metrics = {"kl_ref": float(sums.sum() / max(1.0, float(tokens.sum()))),
                   "kl_reward_penalty": sum(penalties) / max(1, len(penalties)),
                   "time_kl_reward": time.perf_counter() - start}
        return per_group, metrics

    def loss_spec(self, groups: Sequence[Group]) -> LossSpec:
        """The loss of a step with these groups (ExGRPO switches to its mixed-policy loss)."""
        return self.loss

    def step_metrics(self, trained: Sequence[Group], dropped: Sequence[Group]) -> dict[str, float]:
        fresh_rewards = [a.reward for g in (*trained, *dropped) for a in g.fresh()]
        answers = sum(g.size for g in trained)

        def signal_from_replay_only(g: Group) -> bool:
            return g.informative and len({a.correct for a in g.fresh()}) <= 1

        return {
            "reward_mean": sum(fresh_rewards) / max(1, len(fresh_rewards)),
            "groups_all_equal": sum(len(set(g.rewards)) == 1 for g in trained) / max(1, len(trained)),
            "replay_share": sum(g.replay_count for g in trained) / max(1, answers),
            "replayed_questions": sum(g.replay_count > 0 for g in trained),
            # Groups whose fresh rollouts agree (all wrong, or all right) and whose signal
            # comes from the replayed ones alone: what replay adds that sampling did not.
            "groups_signal_from_replay": sum(map(signal_from_replay_only, trained)) / max(1, len(trained)),
            "group_size_min": min((g.size for g in trained), default=0),
            "group_size_max": max((g.size for g in trained), default=0),
        }


def mini_batch_order(groups: Sequence[Group], data_seed: int, step: int) -> list[Group]:
    """The step's groups, whole, in a random order drawn from the data seed and the step (the
    same on a resumed run), with the groups that carry replayed answers spread evenly over it.

    The plans list replayed questions first; the learner splits the batch into mini-batches in
    order, so that the first optimizer step would be all replay and the last all fresh. The
    public ExGRPO code shuffles its questions (unseeded), which makes a mini-batch's replay
    share vary, and on small batches now and then all replay. Here the replayed and the fresh
    groups are shuffled apart and interleaved at their ratio: any run of m consecutive groups
    holds floor or ceil of m x (replayed share) replayed ones, the first group is a replayed
    one and the last a fresh one (a short last mini-batch, left by a batch that is not a
    multiple of the mini-batch size, starts from the fresh end). So no mini-batch is all
    replay while at most half the groups are."""
    rng = random.Random(derive_seed(data_seed, "mini-batch order", step))
    replayed = [g for g in groups if g.replay_count]
    fresh = [g for g in groups if not g.replay_count]
    rng.shuffle(replayed)
    rng.shuffle(fresh)
    n, r = len(groups), len(replayed)
    # Position i holds a replayed group where ceil((i + 1) r / n) steps up from ceil(i r / n):
    # r of the n positions, evenly spaced, the first among them.
    return [replayed.pop() if -(-(i + 1) * r // n) > -(-i * r // n) else fresh.pop() for i in range(n)]

