"""ExGRPO: learn from the run's own experience, kept in a difficulty-bucketed buffer.

- Collection starts the first time a batch's share of correct rollouts exceeds
  `start_pass_rate` (0.35) and never stops; nothing is stored before.
- After each update, per question with k of its K answers correct: 1 <= k < K stores the
  new correct fresh answers (deduplicated by token ids) with their behaviour log-probs, and
  puts the question in bucket k; k = K retires it from the buffer forever.
- Once the buffer holds questions, each batch takes min(floor(rho * B), |buffer|) of its B
  questions from the buffer (bucket chosen with Gaussian weights, question uniform within
  the bucket, without replacement). Such a question gets K - 1 fresh rollouts plus the
  stored answer of lowest mean token entropy under the current policy: one batched
  forward pass on the learner over the sampled questions' stored answers only, each
  answer's entropy averaged over its own response tokens.
- Replayed tokens train with f(w) * A, f(w) = w / (w + beta), w = pi_theta / pi_recorded;
  fresh tokens are unclipped in the mixed phase (the public code) or clipped (the
  paper's eq. 4), as configured. Advantages: group mean subtracted, no std scaling.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rayrep.algos.batch import collate
from rayrep.algos.grpo import GRPO
from rayrep.buffer.replay import ReplayBuffer
from rayrep.buffer.shard import Answer
from rayrep.config import Config, ConfigError
from rayrep.types import Group, LossSpec, Prompt, Rollout


class ExGRPO(GRPO):
    name = "exgrpo"

    def __init__(self, cfg: Config, prompts: list[Prompt]):
        super().__init__(cfg)
        if cfg.algorithm.std_normalize:
            raise ConfigError("algorithm.std_normalize must be false for exgrpo: its advantage is r - mean(r) "
                              "(jobs/exgrpo.py sets it)")
        self.prompts = {p.uid: p for p in prompts}
        self.collecting = False
        self.replay_uids: set[str] = set()
        self.buffer: ReplayBuffer | None = None
        self.learners = None

    def attach(self, runtime) -> None:
        replay = self.cfg.replay
        self.buffer = ReplayBuffer(replay.num_shards, replay.max_answers_per_question, seed=self.cfg.run.seed)
        self.learners = runtime.learners
        self.buffer_questions = 0

    # ------------------------------------------------------------------ the step

    def plan_rollouts(self, fresh: list[Prompt]) -> list[tuple[Prompt, int]]:
        algo = self.cfg.algorithm
        K, B = algo.group_size, len(fresh)
        count = min(math.floor(algo.exgrpo.replay_ratio * B), self.buffer_questions)
        uids = self.buffer.sample_questions(count, K, algo.exgrpo.bucket_sigma) if count else []
        self.replay_uids = set(uids)
        replayed = [self.prompts[uid] for uid in uids]
        fresh = [p for p in fresh if p.uid not in self.replay_uids][: B - len(replayed)]
        return [(p, K - 1) for p in replayed] + [(p, K) for p in fresh]

    def make_groups(self, prompts: list[Prompt], rollouts: list[list[Rollout]], correct: list[list[bool]]) -> list[Group]:
        groups = super().make_groups(prompts, rollouts, correct)
        replay_groups = [g for g in groups if g.prompt.uid in self.replay_uids]
        if replay_groups:
            chosen = self.lowest_entropy_answers([g.prompt.uid for g in replay_groups])
            for group in replay_groups:
                answer = chosen[group.prompt.uid]
                group.rollouts.append(Rollout(
                    prompt_ids=group.rollouts[0].prompt_ids, response_ids=answer.response_ids.tolist(),
                    logprobs=answer.logprobs.tolist(), text="", finish_reason="stop", version=answer.version,
                ))
                group.correct.append(True)
                group.replayed.append(True)
        return groups

    def lowest_entropy_answers(self, uids: list[str]) -> dict[str, Answer]:
        """Per question, its stored answer of lowest mean token entropy under the current policy."""
        stored = self.buffer.all_answers(uids)
        candidates, owners = [], []
        for uid in uids:
            prompt_ids, answers = stored[uid]
            for answer in answers:
                rollout = Rollout(prompt_ids.tolist(), answer.response_ids.tolist(), answer.logprobs.tolist(), "", "stop")
                candidates.append(Group(self.prompts[uid], [rollout], [True], [True]))
                owners.append((uid, answer))
        batch = collate(candidates, torch.zeros(len(candidates)), [False] * len(candidates), temperature=1.0)
        _, entropy = self.learners.compute_logprobs(batch, with_entropy=True)
        mean_entropy = mean_token_entropy(entropy, batch.response_mask)
        best: dict[str, tuple[float, Answer]] = {}
        for (uid, answer), value in zip(owners, mean_entropy.tolist()):
            if uid not in best or value < best[uid][0]:
                best[uid] = (value, answer)
        self.selected_entropy = sum(v for v, _ in best.values()) / max(1, len(best))
        return {uid: answer for uid, (_, answer) in best.items()}

    def recompute_old(self, group: Group) -> list[bool]:
        # Replayed answers keep their recorded behaviour log-probs: w = pi_theta / pi_recorded.
        return [not replayed for replayed in group.replayed]

    def loss_spec(self) -> LossSpec:
        spec = super().loss_spec()
        if not self.replay_uids:
            return spec
        exgrpo = self.cfg.algorithm.exgrpo
        return LossSpec(**{**spec.__dict__, "clip": exgrpo.clip_fresh_in_mixed, "replay_shaping": True,
                           "replay_beta": exgrpo.beta})

    def after_update(self, step: int, groups: list[Group]) -> dict:
        K = self.cfg.algorithm.group_size
        fresh_marks = [ok for g in groups for ok, replayed in zip(g.correct, g.replayed) if not replayed]
        pass_rate = sum(fresh_marks) / max(1, len(fresh_marks))
        if not self.collecting and pass_rate > self.cfg.algorithm.exgrpo.start_pass_rate:
            self.collecting = True  # one-way
        metrics = {"exgrpo_collecting": float(self.collecting), "exgrpo_replayed_questions": len(self.replay_uids)}
        if self.replay_uids:
            metrics["exgrpo_selected_entropy"] = self.selected_entropy
        if not self.collecting:
            return metrics
        items, buckets, retire = [], {}, []
        for group in groups:
            k = sum(group.correct)
            uid = group.prompt.uid
            if k == K:
                retire.append(uid)
            elif k >= 1:
                buckets[uid] = k
                new = [
                    Answer(np.array(r.response_ids, np.int32), np.array(r.logprobs, np.float32), reward, r.version, "online", step)
                    for r, ok, replayed, reward in zip(group.rollouts, group.correct, group.replayed, group.rewards)
                    if ok and not replayed
                ]
                items.append((uid, np.array(group.rollouts[0].prompt_ids, np.int32), new))
        stats = self.buffer.apply(items, dedup=True, buckets=buckets, retire=retire)
        self.buffer_questions = stats["questions"]
        metrics.update({
            "buffer_questions": stats["questions"], "buffer_answers": stats["answers"],
            "buffer_retired": stats["retired"], "buffer_bytes": stats["bytes"], "buffer_stored": stats["stored"],
        })
        metrics.update({f"buffer_bucket_{k}": n for k, n in sorted(stats["buckets"].items())})
        return metrics

    def save(self, run_dir) -> None:
        self.buffer.snapshot(run_dir / "buffer")

    def shutdown(self) -> None:
        if self.buffer is not None:
            self.buffer.shutdown()


def mean_token_entropy(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] mean of each row's entropies over its own masked (response) positions."""
    mask = mask.to(entropy.dtype)
    return (entropy * mask).sum(-1) / mask.sum(-1).clamp_min(1)
