"""ExGRPO: learn from the run's own experience, kept in a difficulty-bucketed buffer.

- The switch flips after the first step whose share of correct rollouts exceeds
  `start_pass_rate` (0.35), for good. As in the public code, that step's own groups are not
  stored: the next step is the first to collect (and trains with the mixed loss, with
  nothing to replay yet), and the one after it the first to replay.
- After each update, per question with k of its K answers correct: once collecting,
  1 <= k < K stores the new correct fresh answers (deduplicated by token ids) with their
  behaviour log-probs and puts the question in bucket k. k = K retires the question: out
  of the buffer forever and, from the next epoch on, out of the training set, at every
  step from the first (the public code); `retire_from: buffer` retires it from the buffer
  only, and only once collecting.
- Once the buffer holds questions, each batch takes min(floor(rho * B), |buffer|) of its B
  questions from the buffer (bucket chosen with Gaussian weights, question uniform within
  the bucket, without replacement) and the rest from the prompt sampler. Such a question
  gets K - 1 fresh rollouts plus the stored answer of lowest mean token entropy under the
  current policy: one batched forward pass on the learners over the sampled questions'
  stored answers only, each answer's entropy averaged over its own response tokens, once
  the rollouts are in and the learners hold the GPUs (`join_replays`).
- From the step after the switch (one-way), replayed tokens train with f(w) * A,
  f(w) = w / (w + beta), w = pi_theta / pi_recorded, and fresh tokens are unclipped (the
  public code) or clipped (the paper's eq. 4), as configured. Advantages: group mean
  subtracted, no std scaling.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from rayrep.algos.grpo import GRPO
from rayrep.algos.interface import AlgorithmInputs
from rayrep.algos.sampling.exgrpo import sample_questions
from rayrep.buffer.answers import DrawLimit, Origin, fresh_successes
from rayrep.buffer.replay import ReplayStore
from rayrep.config import Config, ConfigError
from rayrep.data import PromptSampler
from rayrep.learner.group import LearnerGroup
from rayrep.types import Answer, Group, LossSpec, Prompt, StepBatch, StepPlan


def check_exgrpo_settings(cfg: Config) -> None:
    if cfg.algorithm.std_normalize:
        raise ConfigError("algorithm.std_normalize must be false for exgrpo: its advantage is r - mean(r) "
                          "(choosing exgrpo sets it; leave --algorithm.std_normalize out)")


class ExGRPO(GRPO):
    name = "exgrpo"
    label = "ExGRPO"
    replays = True
    settings = {"algorithm.std_normalize": False}  # its advantage is r - mean(r)
    # Replayed answers keep their recorded behaviour log-probs: w = pi_theta / pi_recorded.
    replay_old_logprobs = "recorded"

    @classmethod
    def check_inputs(cls, cfg: Config, inputs: AlgorithmInputs) -> AlgorithmInputs:
        check_exgrpo_settings(cfg)
        return inputs

    @classmethod
    def create(cls, cfg: Config, inputs: AlgorithmInputs, buffer: ReplayStore | None, learners: LearnerGroup | None,
               sampler: PromptSampler) -> ExGRPO:
        return cls(cfg, inputs.prompts, inputs.prompt_ids, buffer, learners, sampler, inputs.origin)

    def __init__(self, cfg: Config, prompts: list[Prompt], prompt_ids: dict[str, list[int]], buffer: ReplayStore,
                 learners: LearnerGroup | None, sampler: PromptSampler, origin: Origin = Origin()):
        """`learners`: where the entropy pass that chooses replayed answers runs (None only
        where no step replays: tests of the buffer's bookkeeping); `sampler`: the run's
        training set, which retired questions leave (the one the loop plans from)."""
        check_exgrpo_settings(cfg)
        super().__init__(cfg, origin, learners)
        self.buffer, self.sampler = buffer, sampler
        self.prompts = {p.uid: p for p in prompts}
        self.prompt_ids = prompt_ids
        self.collecting = False
        """The one-way switch. What lives across steps is this, the buffer, `replayed_last` and
        `retired_here` (all in `state()`, or the buffer's own snapshot)."""
        self.replayed_last: frozenset[str] = frozenset()
        """The questions the last replaying step replayed (for `exgrpo_replayed_again` only)."""
        self.retires_for_all = buffer.retires_for_everyone(cfg.replay.retire_scope)
        self.retired_here: set[str] = set()
        """Questions this run retired, on a shared pool that retires per run: never drawn by
        it again, still there for the others (`replay.retire_scope = "run"`)."""

    # ------------------------------------------------------------------ the step

    def plan(self, sampler: PromptSampler, questions: int, exclude: frozenset[str] = frozenset(),
             version: int = 0) -> StepPlan:
        """rho x B questions from the buffer (K - 1 fresh rollouts plus their chosen stored
        answer each), then B minus those from the sampler with K rollouts each: no fresh
        question is drawn only to be discarded."""
        algo = self.cfg.algorithm
        K, B = algo.group_size, questions
        count = math.floor(algo.exgrpo.replay_ratio * B) if self.collecting else 0
        uids = sample_questions(self.buffer, count, K, algo.exgrpo.bucket_sigma,
                                exclude=exclude | self.retired_here) if count else []
        taken = exclude | set(uids)
        fresh = [p for p in sampler.next(B - len(uids)) if p.uid not in taken]
        requests = [(self.prompts[uid], K - 1) for uid in uids] + [(p, K) for p in fresh]
        # Which stored answer joins each drawn question is chosen after generation
        # (`join_replays`): its entropy pass needs the learners' weights on the GPU, which
        # colocated GPUs give the engines until then. The policy is the same either way.
        return StepPlan(tuple(requests), choose=tuple(uids))

    def join_replays(self, groups: Sequence[Group]) -> tuple[list[Group], dict[str, float]]:
        """Each group with a pending replay gets its question's stored answer of lowest mean
        token entropy under the current policy (one batched pass on the learners). A question
        the buffer no longer holds (retired while an asynchronous round sampled it) trains
        on its fresh rollouts alone."""
        pending = [g for g in groups if g.pending_replays]
        if not pending:
            return list(groups), {}
        uids = [g.prompt.uid for g in pending]
        start = time.perf_counter()
        # The draw limit counts from the policy version that sampled the step's fresh answers.
        version = max(a.version for g in pending for a in g.answers)
        chosen, entropy = self.lowest_entropy_answers(uids, self.draw_limit(version))
        # How often the same questions come back: the code's narrow bucket weights draw the
        # middle buckets first, and when those hold few questions the same ones are replayed
        # step after step (the share of this step's replayed questions, those that got a
        # stored answer, that the last replaying step replayed too).
        replayed = frozenset(chosen)
        again = len(self.replayed_last & replayed) / len(replayed) if replayed else 0.0
        metrics = {"time_select": time.perf_counter() - start, "exgrpo_selected_entropy": entropy,
                   "exgrpo_replays_gone": float(len(uids) - len(chosen)), "exgrpo_replayed_again": again}
        # How many of the chosen answers other runs sampled: of a shared pool's; of a run's own
        # buffer none (unless its folder moved between a stop and its resume: the answers name
        # the folder they were sampled in).
        metrics["exgrpo_replays_from_others"] = float(sum(a.run != self.origin.run for a in chosen.values()))
        joined = [g.with_replays((chosen[g.prompt.uid],) if g.prompt.uid in chosen else ())
                  if g.pending_replays else g for g in groups]
        return joined, metrics

    def lowest_entropy_answers(self, uids: list[str], limit: DrawLimit | None = None
                               ) -> tuple[dict[str, Answer], float]:
        """Per question, its stored answer of lowest mean token entropy under the current
        policy among those `limit` allows, and the mean of the chosen answers' entropies.

        The stored answers go from the shards to the learners as object refs; each learner
        rank reduces its rows to one mean per answer over the answer's own response tokens,
        and of the chosen answers only their facts come here: each stays in its shard's
        result (`Answer.at`), where the learners read it when they train on it.
        """
        parts = self.buffer.stored_answers(uids, limit)
        means = self.learners.mean_entropies([ref for _, ref in parts])
        picks: dict[str, int] = {}
        lowest: list[float] = []
        for (index, _), values in zip(parts, means):
            row = 0
            for uid, serials in index:
                own = values[row : row + len(serials)]
                pick = int(own.argmin())  # the first (oldest) on a tie
                picks[uid] = serials[pick]
                lowest.append(float(own[pick]))
                row += len(serials)
        return self.buffer.answers_by_serial(picks), sum(lowest) / max(1, len(lowest))

    def loss_spec(self, groups: Sequence[Group]) -> LossSpec:
        """The mixed-policy loss from the step after collection starts, for good (a one-way
        switch, as in the code, whether or not a step happens to replay): shaped replayed
        tokens, and fresh tokens unclipped (the code) or clipped (the paper's eq. 4)."""
        if not self.collecting:
            return self.loss
        exgrpo = self.cfg.algorithm.exgrpo
        return dataclasses.replace(self.loss, clip_fresh=exgrpo.clip_fresh_in_mixed, replay_loss="shaped",
                                   replay_beta=exgrpo.beta)

    def after_update(self, step: int, batch: StepBatch) -> dict[str, float]:
        """Every verified group of the step (trained or dropped) updates the buffer and the
        training set; the switch flips last, so that the step that flips it stores nothing."""
        K = self.cfg.algorithm.group_size
        exgrpo = self.cfg.algorithm.exgrpo
        seen = batch.seen
        all_right = [g.prompt.uid for g in seen if sum(g.correct) == K]
        metrics = {}
        if exgrpo.retire_from == "training-set":
            self.sampler.retire(all_right)  # left out of the training set from the next epoch on
        if self.collecting or exgrpo.retire_from == "training-set":
            items, buckets = [], {}
            for group in seen if self.collecting else ():
                if 1 <= (k := sum(group.correct)) < K:
                    buckets[group.prompt.uid] = k
                    items.append((group.prompt.uid, np.array(self.prompt_ids[group.prompt.uid], np.int32),
                                  fresh_successes(group, step, self.origin)))
            if not self.retires_for_all:
                self.retired_here.update(all_right)
                items = [item for item in items if item[0] not in self.retired_here]
                buckets = {uid: k for uid, k in buckets.items() if uid not in self.retired_here}
            stats = self.buffer.apply(items, dedup=True, buckets=buckets,
                                      retire=all_right if self.retires_for_all else ())
            metrics.update(self.buffer_metrics(stats))
        fresh_marks = [a.correct for g in seen for a in g.fresh()]
        if not self.collecting and sum(fresh_marks) / max(1, len(fresh_marks)) > exgrpo.start_pass_rate:
            self.collecting = True  # one-way; the next step collects, the one after replays
        replayed = frozenset(g.prompt.uid for g in batch.groups if g.replay_count)
        if replayed:  # a step whose sampled questions all left the buffer replayed nothing
            self.replayed_last = replayed  # (`join_replays` counts the next step's replayed again)
        metrics["exgrpo_collecting"] = float(self.collecting)
        metrics["exgrpo_epoch_questions"] = float(self.sampler.active)  # the training set this epoch
        return metrics

    @staticmethod
    def buffer_metrics(stats: dict) -> dict[str, float]:
        metrics = {
            "buffer_questions": stats["questions"], "buffer_answers": stats["answers"],
            "buffer_retired": stats["retired"], "buffer_bytes": stats["bytes"], "buffer_stored": stats["stored"],
        }
        metrics.update({f"buffer_bucket_{k}": n for k, n in sorted(stats["buckets"].items())})
        return metrics

    def state(self) -> dict:
        return {"collecting": self.collecting, "replayed_last": sorted(self.replayed_last),
                "retired_here": sorted(self.retired_here)}

    def load_state(self, state: dict) -> None:
        self.collecting = bool(state["collecting"])
        self.replayed_last = frozenset(state.get("replayed_last", ()))  # absent from older checkpoints
        self.retired_here = set(state.get("retired_here", ()))
