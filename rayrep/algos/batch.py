"""Turning groups of answers into the learner's `TrainBatch`."""

from __future__ import annotations

import torch

from rayrep.types import Group, TrainBatch


def collate(
    groups: list[Group],
    advantages: torch.Tensor,
    recompute_old: list[bool],
    temperature: float,
    pad_id: int = 0,
) -> TrainBatch:
    """Rows in group order (answers of one question adjacent), right-padded.

    `advantages` and `recompute_old` hold one entry per answer, in the same order.
    """
    rollouts = [r for g in groups for r in g.rollouts]
    lengths = torch.tensor([len(r.prompt_ids) + len(r.response_ids) for r in rollouts], dtype=torch.long)
    width = int(lengths.max()) if len(rollouts) else 1
    input_ids = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(rollouts), width), dtype=torch.bool)
    old_logprobs = torch.zeros((len(rollouts), width), dtype=torch.float32)
    for row, rollout in enumerate(rollouts):
        start, end = len(rollout.prompt_ids), int(lengths[row])
        input_ids[row, :start] = torch.tensor(rollout.prompt_ids)
        input_ids[row, start:end] = torch.tensor(rollout.response_ids, dtype=torch.long)
        response_mask[row, start:end] = True
        old_logprobs[row, start:end] = torch.tensor(rollout.logprobs, dtype=torch.float32)
    prompt_index = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts], dtype=torch.long)
    return TrainBatch(
        input_ids=input_ids,
        lengths=lengths,
        response_mask=response_mask,
        old_logprobs=old_logprobs,
        recompute_old=torch.tensor(recompute_old, dtype=torch.bool),
        advantages=advantages.to(torch.float32),
        replay_mask=torch.tensor([flag for g in groups for flag in g.replayed], dtype=torch.bool),
        prompt_index=prompt_index,
        temperature=temperature,
    )
