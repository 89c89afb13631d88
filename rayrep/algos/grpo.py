"""GRPO / DAPO, the baseline every replay method builds on.

The RLEP paper's baseline "DAPO-nodyn-bs64": group-normalised advantages, token-mean
loss, clip-higher (0.2 / 0.28) with dual clip, overlong reward shaping, no KL, no entropy
bonus; dynamic sampling is an option (off).

An algorithm answers four questions for the driver: which questions to roll out and how
many answers each gets (`plan_rollouts`), what groups to train on once they are verified
(`make_groups`), the loss to train with (`loss_spec`), and what to remember afterwards
(`after_update`). GRPO trains on fresh groups only; RLEP and ExGRPO (rlep.py, exgrpo.py)
override what they change.
"""

from __future__ import annotations

import torch

from rayrep.algos.advantages import group_advantages, overlong_penalty
from rayrep.algos.batch import collate
from rayrep.config import Config
from rayrep.types import Group, LossSpec, Prompt, Rollout, TrainBatch


class GRPO:
    name = "grpo"

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def attach(self, runtime) -> None:
        """Called once the actors are up (replay methods start their buffer shards here)."""

    def save(self, run_dir) -> None:
        """Persist what a resumed run would need besides the weights (the replay buffer)."""

    def shutdown(self) -> None:
        pass

    # ------------------------------------------------------------------ the driver's questions

    def plan_rollouts(self, fresh: list[Prompt]) -> list[tuple[Prompt, int]]:
        """(question, number of fresh answers) to sample this step."""
        return [(prompt, self.cfg.algorithm.group_size) for prompt in fresh]

    def make_groups(self, prompts: list[Prompt], rollouts: list[list[Rollout]], correct: list[list[bool]]) -> list[Group]:
        return [
            Group(prompt, list(answers), list(marks), [False] * len(answers))
            for prompt, answers, marks in zip(prompts, rollouts, correct)
        ]

    def loss_spec(self) -> LossSpec:
        learner = self.cfg.learner
        return LossSpec(
            clip_low=learner.clip_low,
            clip_high=learner.clip_high,
            dual_clip=learner.dual_clip or None,
            agg=learner.loss_agg,
            norm_constant=learner.loss_norm_constant if learner.loss_agg == "seq-mean-token-sum" else None,
            entropy_coef=learner.entropy_coef,
        )

    def after_update(self, step: int, groups: list[Group]) -> dict:
        return {}

    def recompute_old(self, group: Group) -> list[bool]:
        """Per answer: whether the learner recomputes its old log-prob (fresh ones always do)."""
        return [True] * group.size

    # ------------------------------------------------------------------ shared by every algorithm

    def score(self, groups: list[Group]) -> None:
        """Rewards: the verifier's verdict (+1/-1 or 1/0) plus DAPO's overlong shaping."""
        verifier, limit = self.cfg.verifier, self.cfg.generator.max_response_tokens
        high, low = (1.0, -1.0) if verifier.reward_style == "dapo" else (1.0, 0.0)
        for group in groups:
            base = torch.tensor([high if ok else low for ok in group.correct])
            if verifier.overlong_factor > 0:
                lengths = torch.tensor([len(r.response_ids) for r in group.rollouts])
                base = base + overlong_penalty(lengths, limit, verifier.overlong_buffer, verifier.overlong_factor)
            group.rewards = base.tolist()

    def build_batch(self, groups: list[Group]) -> TrainBatch:
        """Advantages over each whole group (fresh and replayed answers together), then the batch."""
        self.score(groups)
        rewards = [r for g in groups for r in g.rewards]
        index = [i for i, g in enumerate(groups) for _ in g.rollouts]
        algo = self.cfg.algorithm
        advantages = group_advantages(rewards, index, std_normalize=algo.std_normalize, eps=algo.advantage_eps)
        recompute = [flag for g in groups for flag in self.recompute_old(g)]
        return collate(groups, advantages, recompute, temperature=self.cfg.generator.temperature)

