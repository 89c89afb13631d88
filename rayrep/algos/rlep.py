"""RLEP: replay verified successes of an earlier run in every GRPO group.

Phase 1 (`collect_pool`): a checkpoint of a finished baseline run samples n answers per
training question; the verified-correct ones are kept, questions with fewer than two
dropped, and the pool is written with token ids and behaviour log-probs.

Phase 2 (`RLEP`): training starts again from the base policy; each question gets G fresh
rollouts plus up to M successes drawn uniformly without replacement from its pool, and
advantages are taken over all G' = G + M answers. Unlike the public code:
- a question with fewer than M stored successes gets what it has, never placeholder
  answers (the public code pads with fake one-token failures);
- mini-batches are whole questions with all their answers, so the number of optimizer
  steps per rollout does not depend on M (the public code scales by G and takes 9 steps
  where the baseline takes 8);
- answers are replayed as the token ids the policy produced, never re-tokenized text.

Beyond the paper, each a config option (off by default):
- adaptive replay (`replay_if_at_most k`): stored successes join a group only when at most
  k of its fresh answers are correct, where the group needs them; elsewhere they only
  dilute its signal;
- a growing pool (`grow_pool`): each step's verified fresh successes join the pool, as
  ExGRPO's buffer collects them, so that the pool keeps up with the policy;
- importance-corrected replay is the learner's decoupled loss (`learner.behaviour_cap`):
  replayed answers are weighted by their truncated ratio to the recorded behaviour
  log-probs, the same code that corrects asynchronous rollouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rayrep.algos.grpo import GRPO
from rayrep.algos.interface import AlgorithmInputs
from rayrep.algos.sampling.rlep import draw_answers
from rayrep.buffer.answers import Origin, fresh_successes
from rayrep.buffer.files import BufferFileError, pool_checkers, read_pool
from rayrep.buffer.replay import ReplayStore
from rayrep.config import Config, ConfigError
from rayrep.data import PromptSampler
from rayrep.learner.group import LearnerGroup
from rayrep.types import Answer, Group, StepBatch, StepPlan
from rayrep.verifier.checkers import Routing

ExperiencePool = dict[str, tuple[np.ndarray, list[Answer]]]
"""{question uid: (its prompt tokens, its stored successes)}, as `read_pool` returns it."""


class RLEP(GRPO):
    name = "rlep"
    label = "RLEP"
    replays = True
    pool_from_baseline = True

    @classmethod
    def check_inputs(cls, cfg: Config, inputs: AlgorithmInputs) -> AlgorithmInputs:
        """The experience pool, read and checked against this run's prompt tokens; a run
        attached to a shared pool (`replay.pool`) replays that instead, and is given no pool
        file of its own."""
        if cfg.replay.pool:
            if cfg.algorithm.rlep.pool:
                raise ConfigError(
                    f"algorithm.rlep.pool={cfg.algorithm.rlep.pool!r} and replay.pool={cfg.replay.pool!r}: an RLEP run "
                    f"attached to a shared pool replays what the shared pool holds, not an experience pool file; "
                    f"import the file into the shared pool first (jobs/pool.py import --name {cfg.replay.pool} "
                    f"{cfg.algorithm.rlep.pool})")
            return inputs
        return dataclasses.replace(inputs, pool=load_pool(cfg, inputs.prompt_ids))

    @classmethod
    def create(cls, cfg: Config, inputs: AlgorithmInputs, buffer: ReplayStore | None, learners: LearnerGroup | None,
               sampler: PromptSampler) -> RLEP:
        return cls(cfg, inputs.prompt_ids, inputs.pool, buffer, inputs.origin, learners)

    def __init__(self, cfg: Config, prompt_ids: dict[str, list[int]], pool: ExperiencePool | None, buffer: ReplayStore,
                 origin: Origin = Origin(), learners: LearnerGroup | None = None):
        """`pool`: from `load_pool`, checked against `prompt_ids`; it goes into `buffer`'s
        shards now (None: a shared pool the buffer is attached to holds the successes)."""
        super().__init__(cfg, origin, learners)
        self.prompt_ids = prompt_ids
        self.replay_old_logprobs = cfg.algorithm.rlep.old_logprobs
        self.draws_logprobs = self.replay_old_logprobs == "recorded" or bool(cfg.learner.behaviour_cap)
        """Whether the learner reads replayed answers' behaviour log-probs: as their old
        policy ('recorded'), or for the importance weight (`behaviour_cap`). By default it
        recomputes them, and a draw without them moves half the bytes."""
        self.buffer = buffer
        if pool is not None:
            self.buffer.add([(uid, ids, answers) for uid, (ids, answers) in pool.items()])

    def plan(self, sampler: PromptSampler, questions: int, exclude: frozenset[str] = frozenset(),
             version: int = 0) -> StepPlan:
        """G fresh rollouts per question, and up to M of its stored successes (those the draw
        limit allows at policy version `version`), drawn now."""
        fresh = super().plan(sampler, questions, exclude)
        wanted = self.cfg.algorithm.rlep.replays_per_group
        requests = [(p.uid, wanted) for p in fresh.prompts]
        # Left in the shards' results: the learners read the drawn answers from there.
        drawn = draw_answers(self.buffer, requests, self.draw_limit(version), self.draws_logprobs,
                             by_reference=True) if wanted else {}
        replays = {uid: tuple(answers) for uid, answers in drawn.items() if answers}
        at_most = self.cfg.algorithm.rlep.replay_if_at_most
        return StepPlan(fresh.requests, replays, replay_if_at_most=at_most if at_most >= 0 else None)

    def after_update(self, step: int, batch: StepBatch) -> dict[str, float]:
        """With `grow_pool`, every verified group's fresh successes join the pool."""
        if not self.cfg.algorithm.rlep.grow_pool:
            return {}
        items = [(group.prompt.uid, np.array(self.prompt_ids[group.prompt.uid], np.int32), new)
                 for group in batch.seen if (new := fresh_successes(group, step, self.origin))]
        stats = self.buffer.apply(items, dedup=True)
        return {"pool_questions": stats["questions"], "pool_answers": stats["answers"], "pool_stored": stats["stored"]}

    def step_metrics(self, trained: Sequence[Group], dropped: Sequence[Group]) -> dict[str, float]:
        wanted = self.cfg.algorithm.rlep.replays_per_group
        return {
            **super().step_metrics(trained, dropped),
            "replay_questions_short": sum(g.replay_count < wanted for g in trained),
        }


def load_pool(cfg: Config, prompt_ids: dict[str, list[int]]) -> ExperiencePool:
    """The experience pool `algorithm.rlep.pool`, read and checked against this run's prompt
    tokens (and, for `old_logprobs = 'recorded'`, for behaviour log-probs)."""
    settings = cfg.algorithm.rlep
    if not settings.pool:
        raise ConfigError("algorithm.rlep.pool: RLEP needs an experience pool (jobs/collect.py writes one)")
    check_pool_checkers(cfg, settings.pool)
    pool = read_pool(settings.pool)
    check_pool(pool, prompt_ids, settings.pool, settings.old_logprobs)
    return pool


def check_pool_checkers(cfg: Config, path: str) -> None:
    """A pool's successes are successes by the checker that judged them: this run must score
    each of its data sources with the same one."""
    routing = Routing.of(cfg.verifier)
    for source, checker in sorted(pool_checkers(path).items()):
        if (ours := routing.checker(source)) != checker:
            raise BufferFileError(
                f"{path}: its answers of data_source {source!r} were judged by checker {checker!r}; this run scores "
                f"{source!r} with {ours!r} (verifier.reward, verifier.by_source)")


def check_pool(pool: dict, prompt_ids: dict[str, list[int]], path: str, old_logprobs: str) -> None:
    """Every pooled question must render to the same prompt tokens as in this run."""
    known = [uid for uid in pool if uid in prompt_ids]
    if not known:
        raise BufferFileError(f"{path}: none of its {len(pool)} questions is in this run's training set")
    for uid in known:
        stored, answers = pool[uid]
        if stored.tolist() != list(prompt_ids[uid]):
            raise BufferFileError(
                f"{path}: question {uid!r} was pooled with other prompt tokens than this run's tokenizer and "
                f"chat template give; rebuild the pool with this policy's tokenizer"
            )
        if old_logprobs == "recorded" and not all(a.arrays().logprobs_known for a in answers):
            raise ConfigError(
                f"algorithm.rlep.old_logprobs='recorded' but {path} has no behaviour log-probs for question "
                f"{uid!r} (an imported text pool); use 'recompute'"
            )
