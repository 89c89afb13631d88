"""Answer-level prioritised replay: stored answers drawn one by one, by how much they still teach.

RLEP replays a fixed pool's successes and ExGRPO a question's lowest-entropy success; both
choose by question. Here every answer a step trained on, right or wrong, whose group had
signal, enters the buffer with the advantage it was trained with, the policy version that
sampled it and its behaviour log-probs; each step keeps all its fresh groups and adds stored
answers of other questions until they are `replay_share` of the batch's answers, drawn
without replacement with priority

    |A| x exp(-age / tau),   age = the sampling policy's version now minus the answer's

(Freshness-Aware PER, arXiv 2604.16918: |A| alone made results worse there; the decay
keeps the draw near the policy). Answers older than `max_age` versions are evicted (the
answer-level buffer of arXiv 2606.04560 bounds their age the same way). The draw is an
exponential race on the shards (`rayrep.algos.sampling.prioritized`): two calls per shard, the
second moving only the answers drawn.

A replayed answer trains with its stored advantage (not one taken again in a group: its
question is not sampled this step), in a group of its own question's replayed answers that
rides in a fresh group's mini-batch, so that the optimizer steps per rollout stay those of
the baseline and each mini-batch gets its share of replays. Its tokens are corrected
against the policy that sampled them: decoupled PPO (ratio to the learner's weights at the
update's start, each token weighted by min(pi_prox / pi_behaviour, cap), the same code as
asynchronous rollouts), or ExGRPO's shaping f(w) = w / (w + beta) against the recorded
log-probs, as configured.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from rayrep.algos.grpo import GRPO
from rayrep.algos.interface import AlgorithmInputs
from rayrep.algos.sampling.prioritized import race_answers
from rayrep.buffer.answers import Origin, as_stored, origin_id
from rayrep.buffer.replay import ReplayStore
from rayrep.config import Config, ConfigError
from rayrep.data import PromptSampler
from rayrep.learner.group import LearnerGroup
from rayrep.types import Answer, BatchRow, Group, Prompt, StepBatch

DEFAULT_BEHAVIOUR_CAP = 2.0
"""The decoupled correction's cap where `learner.behaviour_cap` sets none (the study's RLEP-IS arm's)."""


def check_prioritized_settings(cfg: Config) -> None:
    settings, correction = cfg.algorithm.prioritized, cfg.learner.correction
    if settings.correction == "decoupled" and correction.weights != "none":
        raise ConfigError(f"algorithm.prioritized.correction='decoupled' weighs every token by pi_prox / pi_behaviour, "
                          f"as learner.correction.weights={correction.weights!r} does the fresh ones: set "
                          f"learner.correction.weights='none' or algorithm.prioritized.correction='shaped'")


class Prioritized(GRPO):
    name = "prioritized"
    label = "Prioritized"
    replays = True

    @classmethod
    def check_inputs(cls, cfg: Config, inputs: AlgorithmInputs) -> AlgorithmInputs:
        check_prioritized_settings(cfg)
        return inputs

    @classmethod
    def create(cls, cfg: Config, inputs: AlgorithmInputs, buffer: ReplayStore | None, learners: LearnerGroup | None,
               sampler: PromptSampler) -> Prioritized:
        return cls(cfg, inputs.prompts, inputs.prompt_ids, buffer, inputs.origin, learners)

    def __init__(self, cfg: Config, prompts: list[Prompt], prompt_ids: dict[str, list[int]], buffer: ReplayStore,
                 origin: Origin = Origin(), learners: LearnerGroup | None = None):
        check_prioritized_settings(cfg)
        super().__init__(cfg, origin, learners)
        self.settings = cfg.algorithm.prioritized
        self.prompts = {p.uid: p for p in prompts}
        self.prompt_ids = prompt_ids
        self.buffer = buffer
        if self.settings.correction == "decoupled":
            self.replay_old_logprobs = "recompute"  # the ratio is to the proximal policy; the cap to the recorded
            self.loss = dataclasses.replace(self.loss, behaviour_cap=self.loss.behaviour_cap or DEFAULT_BEHAVIOUR_CAP)
        else:
            self.replay_old_logprobs = "recorded"
            self.loss = dataclasses.replace(self.loss, replay_loss="shaped", replay_beta=self.settings.beta)

    # ------------------------------------------------------------------ the step

    def replays_wanted(self, fresh_answers: int) -> int:
        """Stored answers that make `replay_share` of a batch with `fresh_answers` fresh ones."""
        share = self.settings.replay_share
        return math.floor(share / (1 - share) * fresh_answers + 1e-9)

    def join_replays(self, groups: Sequence[Group]) -> tuple[list[Group], dict[str, float]]:
        """The step's groups and, after them, stored answers of other questions drawn by
        priority, one group per question, each answer with its stored advantage."""
        wanted = self.replays_wanted(sum(g.size for g in groups))
        if not wanted:
            return list(groups), {}
        version = max(a.version for g in groups for a in g.answers)  # the policy that sampled this step
        drawn = race_answers(self.buffer, wanted, version, self.settings.decay_versions, self.settings.max_age,
                             exclude=frozenset(g.prompt.uid for g in groups), limit=self.draw_limit(version))
        by_question: dict[str, list[Answer]] = {}
        for uid, answer in drawn:
            by_question.setdefault(uid, []).append(answer)
        replayed = [
            # Each with its stored advantage; scored with its group as fresh answers are.
            Group(self.prompts[uid], tuple(a._replace(replayed=True, correct=a.correct is True, reward=None)
                                           for a in answers))
            for uid, answers in by_question.items()
        ]
        answers = [a for _, a in drawn]
        ages = [version - a.version for a in answers]
        metrics = {
            "prioritized_replayed": float(len(answers)),
            "prioritized_replayed_questions": float(len(replayed)),
            "prioritized_age_mean": float(np.mean(ages)) if ages else 0.0,
            "prioritized_abs_advantage_mean": float(np.mean([abs(a.advantage) for a in answers])) if answers else 0.0,
            "prioritized_wrong_share": float(np.mean([a.verdict != "correct" for a in answers])) if answers else 0.0,
        }
        return list(groups) + replayed, metrics

    def build(self, groups: Sequence[Group], dropped: Sequence[Group] = (), *, step: int) -> StepBatch:
        """The fresh groups as the baseline builds them; then the replayed groups' rows, each
        with its stored advantage, the replayed groups spread evenly over the fresh groups'
        places (`prompt_index`), so that each mini-batch takes its share of them."""
        fresh = [g for g in groups if not g.advantages]
        stored = [self.score(g) for g in groups if g.advantages]
        batch = super().build(fresh, dropped, step=step)
        if not stored:
            return batch
        recipe, places = batch.recipe, len(batch.groups)
        recompute = self.replay_old_logprobs == "recompute"
        rows = [BatchRow(answer, j * places // len(stored), recompute) for j, g in enumerate(stored) for answer in g.answers]
        recipe = dataclasses.replace(recipe, rows=recipe.rows + tuple(rows))
        metrics = dict(batch.metrics)
        metrics["replay_share"] = len(rows) / max(1, len(recipe.rows))
        metrics["replayed_questions"] = len(stored)
        return StepBatch(recipe, batch.loss, batch.groups + tuple(stored), batch.dropped, metrics)

    def after_update(self, step: int, batch: StepBatch) -> dict[str, float]:
        """Every fresh answer of a trained group with signal enters the buffer with the
        advantage it trained with; answers the next step could no longer draw (older than
        `max_age` versions at the next policy) leave it."""
        items, start, newest = [], 0, 0
        for group in batch.groups:
            trained = [row.answer for row in batch.recipe.rows[start : start + group.size]]  # with their advantages
            start += group.size
            if group.advantages:  # replayed answers: stored already
                continue
            newest = max([newest, *(a.version for a in group.answers)])
            if len(set(group.correct)) > 1:
                answers = as_stored([a for a in trained if not a.replayed], step, self.origin)
                items.append((group.prompt.uid, np.array(self.prompt_ids[group.prompt.uid], np.int32), answers))
        max_age = self.settings.max_age
        evict = (origin_id(self.origin.run, self.origin.checkpoint), newest + 1 - max_age) if max_age >= 0 else None
        stats = self.buffer.apply(items, evict=evict)
        return {"buffer_questions": stats["questions"], "buffer_answers": stats["answers"],
                "buffer_stored": stats["stored"], "buffer_evicted": stats["evicted"], "buffer_bytes": stats["bytes"]}
