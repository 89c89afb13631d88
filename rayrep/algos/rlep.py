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

import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rayrep.algos.grpo import GRPO
from rayrep.buffer.files import BufferFileError, read_pool, write_pool
from rayrep.buffer.shard import Answer
from rayrep.config import Config, ConfigError
from rayrep.types import Group, Prompt, StepBatch, StepPlan

if TYPE_CHECKING:
    from rayrep.buffer.replay import ReplayBuffer
    from rayrep.data import PromptSampler
    from rayrep.learner.group import LearnerGroup


class RLEP(GRPO):
    name = "rlep"

    def __init__(self, cfg: Config, prompt_ids: dict[str, list[int]]):
        super().__init__(cfg)
        settings = cfg.algorithm.rlep
        if not settings.pool:
            raise ConfigError("algorithm.rlep.pool: RLEP needs an experience pool (jobs/collect.py writes one)")
        self.pool: dict | None = read_pool(settings.pool)
        check_pool(self.pool, prompt_ids, settings.pool, settings.old_logprobs)
        self.prompt_ids = prompt_ids
        self.replay_old_logprobs = settings.old_logprobs
        self.buffer: ReplayBuffer | None = None

    def attach(self, buffer: ReplayBuffer | None, learners: LearnerGroup | None) -> None:
        self.buffer = buffer
        self.buffer.add([(uid, prompt_ids, answers) for uid, (prompt_ids, answers) in self.pool.items()])
        self.pool = None  # the shards hold it now

    def plan(self, sampler: PromptSampler, questions: int, exclude: frozenset[str] = frozenset()) -> StepPlan:
        """G fresh rollouts per question, and up to M of its pooled successes, drawn now."""
        fresh = super().plan(sampler, questions, exclude)
        wanted = self.cfg.algorithm.rlep.replays_per_group
        drawn = self.buffer.sample_answers([(p.uid, wanted) for p in fresh.prompts]) if wanted else {}
        replays = {
            uid: tuple(answer.rollout(self.prompt_ids[uid]) for answer in answers)
            for uid, answers in drawn.items() if answers
        }
        at_most = self.cfg.algorithm.rlep.replay_if_at_most
        return StepPlan(fresh.requests, replays, replay_if_at_most=at_most if at_most >= 0 else None)

    def after_update(self, step: int, batch: StepBatch) -> dict[str, float]:
        """With `grow_pool`, every verified group's fresh successes join the pool."""
        if not self.cfg.algorithm.rlep.grow_pool:
            return {}
        items = [(group.prompt.uid, np.array(self.prompt_ids[group.prompt.uid], np.int32), new)
                 for group in batch.seen if (new := Answer.fresh_successes(group, step))]
        stats = self.buffer.apply(items, dedup=True)
        return {"pool_questions": stats["questions"], "pool_answers": stats["answers"], "pool_stored": stats["stored"]}

    def step_metrics(self, trained: Sequence[Group], dropped: Sequence[Group]) -> dict[str, float]:
        wanted = self.cfg.algorithm.rlep.replays_per_group
        return {
            **super().step_metrics(trained, dropped),
            "replay_questions_short": sum(sum(g.replayed) < wanted for g in trained),
        }


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
        if old_logprobs == "recorded" and any(np.isnan(a.logprobs).any() for a in answers):
            raise ConfigError(
                f"algorithm.rlep.old_logprobs='recorded' but {path} has no behaviour log-probs for question "
                f"{uid!r} (an imported text pool); use 'recompute'"
            )


def questions_to_collect(cfg: Config, prompts: list[Prompt]) -> list[Prompt]:
    """The training questions a pool covers: all, or the first `collect_questions` the
    run's prompt sampler visits (the same seeded order the replay run will follow)."""
    from rayrep.data import PromptSampler

    limit = cfg.algorithm.rlep.collect_questions
    if not limit or limit >= len(prompts):
        return list(prompts)
    sampler = PromptSampler(prompts, seed=cfg.seed("data"))
    seen, ordered = set(), []
    while len(ordered) < limit:
        for prompt in sampler.next(cfg.algorithm.prompts_per_step):
            if prompt.uid not in seen:
                seen.add(prompt.uid)
                ordered.append(prompt)
    return ordered[:limit]


def collect_pool(cfg: Config, checkpoint: str, out_path: str | Path, log=print) -> dict:
    """RLEP phase 1: sample, verify, keep the successes of questions with enough of them."""
    from transformers import AutoTokenizer

    from rayrep.data import encode_prompts, load_split
    from rayrep.progress import Progress
    from rayrep.runtime import Runtime

    settings = cfg.algorithm.rlep
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = questions_to_collect(cfg, load_split(cfg.data, "train"))
    prompt_ids = encode_prompts(tokenizer, prompts, cfg.data.max_prompt_tokens)
    start = time.perf_counter()
    runtime = Runtime.start(cfg, checkpoint, train=False, log_dir=Path(out_path).parent)
    rows, kept_questions, samples = [], 0, 0
    recovery: Counter = Counter()
    progress = Progress(len(prompts), "collect", unit="question", log=log)
    try:
        # Slices bound the memory of one generate call; every generator works on each slice.
        size = max(64, 8 * len(runtime.generators.workers))
        seeds = cfg.sampling_seeds("collect", len(prompts))
        for begin in range(0, len(prompts), size):
            part, ids = prompts[begin : begin + size], prompt_ids[begin : begin + size]
            pending = runtime.generators.generate(
                ids, n=settings.collect_samples, temperature=settings.collect_temperature,
                top_p=settings.collect_top_p, max_tokens=cfg.generator.max_response_tokens,
                seeds=seeds[begin : begin + size],
            )
            # A dead generator: replaced, its prompts asked again.
            pending, rollouts = runtime.generators.complete(pending, recovery)
            correct = runtime.verifiers.check(pending, [p.ground_truth for p in part]).correct
            for prompt, sampled, marks in zip(part, rollouts, correct):
                samples += len(sampled)
                successes = [r for r, ok in zip(sampled, marks) if ok]
                if len(successes) < settings.min_successes:
                    continue
                kept_questions += 1
                rows += [{
                    "uid": prompt.uid, "prompt": prompt.messages, "ground_truth": prompt.ground_truth,
                    "data_source": prompt.data_source, "prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
                    "logprobs": r.logprobs, "text": r.text, "reward": 1.0, "version": r.version,
                } for r in successes]
            progress.update(begin + len(part), kept=kept_questions, successes=len(rows))
    finally:
        runtime.shutdown()
    if not rows:
        raise RuntimeError(f"no question had {settings.min_successes} verified successes: the pool would be empty")
    write_pool(rows, Path(out_path), source_checkpoint=str(checkpoint))
    return {
        "pool": str(out_path), "questions": len(prompts), "kept_questions": kept_questions, "successes": len(rows),
        "samples": samples, "success_rate": len(rows) / max(1, samples), "seconds": time.perf_counter() - start,
        **{f"generator_{name}": n for name, n in recovery.items() if n},
    }
