"""The forward passes of one learner rank over a `TrainBatch`'s rows, and how the rows are
split: into mini-batches of whole questions, shares per rank and micro-batches.

A pass runs whole rows (prompt and response, right-padded) or, where the batch allows, each
distinct prompt once (`PolicyForward.shares_prompts`); either way the log-probs and entropies
come from `rayrep.learner.logprobs.token_logprobs`, in fp32 chunks of positions. The worker
(`rayrep.learner.worker`) owns the state and the updates; this module only reads weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rayrep.config import Config
from rayrep.learner.logprobs import token_logprobs
from rayrep.learner.sharding import Sharding, compute_dtype
from rayrep.types import TrainBatch

__all__ = ["Entropy", "Pass", "PolicyForward", "mini_batches", "questions_by_length", "rows_per_rank",
           "token_budget_batches"]

Entropy = Literal["none", "detached", "grad"]
"""Whether a forward pass also returns per-token entropies, and whether they keep a graph."""


def mini_batches(num_prompts: int, mini_batch_prompts: int) -> list[range]:
    """The questions of each optimizer step: whole questions, with all their answers
    (G fresh + M replayed), so the number of steps depends on questions, never on answers."""
    return [range(start, min(start + mini_batch_prompts, num_prompts)) for start in range(0, num_prompts, mini_batch_prompts)]


def rows_per_rank(prompt_index: torch.Tensor, prompts: range, world_size: int) -> list[torch.Tensor]:
    """Row indices of each rank for the questions in `prompts`: whole questions, near-equal shares."""
    ranks = []
    for rank in range(world_size):
        start = prompts.start + (len(prompts) * rank) // world_size
        stop = prompts.start + (len(prompts) * (rank + 1)) // world_size
        ranks.append(torch.nonzero((prompt_index >= start) & (prompt_index < stop)).flatten())
    return ranks


def idle_rows(batch: TrainBatch) -> torch.Tensor:
    """[N] bool: the rows of questions whose every answer (fresh or replayed) has advantage 0,
    a group all right or all wrong: the policy objective gives them no gradient."""
    teaching = torch.zeros(batch.num_prompts, dtype=torch.int64).index_add_(
        0, batch.prompt_index, (batch.advantages != 0).to(torch.int64))
    return teaching[batch.prompt_index] == 0


def questions_by_length(rows: torch.Tensor, prompt_index: torch.Tensor, lengths: torch.Tensor,
                        count: int) -> list[torch.Tensor]:
    """`rows` in `count` micro-batches of whole questions with near-equal numbers of rows (some
    empty when the questions are fewer): the questions ordered by their longest row, so that
    answers of like length share a micro-batch, whose padded width is then about theirs; a
    question's answers stay together, sharing one pass over their prompt."""
    by_question: dict[int, list[int]] = {}
    for row, question in zip(rows.tolist(), prompt_index[rows].tolist()):
        by_question.setdefault(question, []).append(row)
    longest = {question: int(lengths[members].max()) for question, members in by_question.items()}
    ordered = sorted(by_question, key=lambda question: -longest[question])  # stable: ties keep their order
    groups = [by_question[question] for question in ordered]
    ends = [0]
    for members in groups:
        ends.append(ends[-1] + len(members))
    cuts, at = [], 0  # (indices into `ends`: the question boundaries)
    for k in range(1, count):  # the boundary nearest each k/count of the rows
        target = k * ends[-1] / count
        at = min(range(at, len(ends)), key=lambda i: abs(ends[i] - target))
        cuts.append(at)
    flat = torch.tensor([row for members in groups for row in members], dtype=torch.long)
    return [flat[ends[a]:ends[b]] for a, b in zip([0, *cuts], [*cuts, len(groups)])]


def token_budget_batches(rows: torch.Tensor, lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """`rows` in chunks of at most `budget` padded tokens (rows x the chunk's longest row):
    longest first, each chunk filled with the rows that come next in length, so that rows
    of like length share a chunk and little is padding. A row longer than the budget is a
    chunk of its own."""
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    chunks, start = [], 0
    for end in range(1, len(order) + 1):
        longest = int(lengths[order[start]])  # the chunk's first row is its longest
        if end < len(order) and (end + 1 - start) * longest <= budget:
            continue
        chunks.append(order[start:end])
        start = end
    return chunks


@dataclass(frozen=True)
class Pass:
    """A forward pass over a chunk of rows (`PolicyForward.__call__`)."""

    logp: torch.Tensor
    """[n, width] log-prob of every token under the current weights."""
    entropy: torch.Tensor | None
    """[n, width] entropies, or None."""
    width: int
    """The chunk's longest row."""
    dummy: bool
    """An empty chunk's stand-in row: it takes part in the collectives, nothing else."""
    positions: int
    """Positions the model ran (the shared prompts' pass and the rows' rest, or whole rows)."""
    tokens: int
    """Of those, the rows' own tokens: the rest is padding."""


class PolicyForward:
    """Forward passes of one rank's sharded policy (`sharding.model`) over rows of a batch.
    Every rank makes the same calls (a rank short of rows runs dummy ones), since each pass
    takes part in the sharding's collectives."""

    def __init__(self, cfg: Config, sharding: Sharding, device: torch.device, rank: int, world_size: int):
        self.cfg, self.sharding, self.device = cfg, sharding, device
        self.rank, self.world_size = rank, world_size

    def __call__(self, batch: TrainBatch, rows: torch.Tensor, entropy: Entropy) -> Pass:
        """Log-prob (and entropy) of every token of `rows` under the current weights. An empty
        chunk runs one dummy row (`Pass.dummy`) so that every rank takes part in the gradient
        collectives the same number of times."""
        dummy = len(rows) == 0
        if dummy:
            rows = torch.zeros(1, dtype=torch.long)
        width = int(batch.lengths[rows].max())
        if self.shares_prompts(batch):
            return self._shared_prompts(batch, rows, entropy, width, dummy)
        ids = batch.input_ids[rows, :width].to(self.device)
        attention = (torch.arange(width)[None, :] < batch.lengths[rows, None]).to(self.device)
        logits = self.sharding.model(input_ids=ids, attention_mask=attention.long()).logits  # model.dtype
        # In fp32 chunks of positions, from logsumexp: the logits are the one [n, W, V] tensor.
        # Without a coefficient the entropy is only a metric, and no gradient flows through it.
        token_logp, token_entropy = token_logprobs(logits, ids, batch.temperature, entropy,
                                                   self.cfg.learner.logit_chunk_tokens)
        return Pass(token_logp, token_entropy, width, dummy, len(rows) * width, int(batch.lengths[rows].sum()))

    def shares_prompts(self, batch: TrainBatch) -> bool:
        """Whether forward passes over `batch` compute each prompt once: asked of the whole
        batch, so that every rank makes the same forward calls (FSDP2 gathers the weights
        in each). Not with gradient checkpointing (its layers drop a cache), nor for a
        batch with a one-token prompt or an empty response, nor where a rank does not hold
        whole parameters (`Sharding.whole_parameters`: FSDP2 over several ranks or in bf16)."""
        learner = self.cfg.learner
        if not (learner.shared_prompts and self.sharding.whole_parameters) or learner.gradient_checkpointing:
            return False
        starts = batch.response_mask.to(torch.int8).argmax(1)
        return bool((starts >= 2).all()) and bool((batch.lengths > starts).all())

    def _shared_prompts(self, batch: TrainBatch, rows: torch.Tensor, entropy: Entropy, width: int, dummy: bool) -> Pass:
        """`__call__`'s pass with each distinct prompt of
        `rows` computed once: a question's answers share their prompt, which is often most
        of a row (on the tiny task, 34 of 56 tokens, for G = 8 answers each).

        Pass 1 runs every distinct prompt but its last token and keeps its keys and values
        (a `DynamicCache`, in the graph); pass 2 runs each row's last prompt token and
        response, its queries attending to its own prompt's cached keys (picked per row, so
        the gradient of every answer flows back into the one prompt pass) and causally to
        its own tokens. Positions and masks are each row's own, so the log-probs are the
        whole-row pass's up to round-off."""
        from transformers import DynamicCache

        starts = batch.response_mask[rows].to(torch.int8).argmax(1)  # first response position = prompt length
        ends = batch.lengths[rows]
        keys = [tuple(batch.input_ids[row, : start - 1].tolist()) for row, start in zip(rows.tolist(), starts.tolist())]
        distinct: dict[tuple[int, ...], int] = {}
        owner = torch.tensor([distinct.setdefault(key, len(distinct)) for key in keys])
        prefix_width = max(map(len, distinct))
        prefix_ids = torch.zeros(len(distinct), prefix_width, dtype=torch.long)
        prefix_lengths = torch.tensor([len(key) for key in distinct])
        for index, key in enumerate(distinct):
            prefix_ids[index, : len(key)] = torch.tensor(key)
        model, device = self.sharding.model, self.device
        cache = DynamicCache(config=self.sharding.module.config)
        prefix_attention = (torch.arange(prefix_width)[None, :] < prefix_lengths[:, None]).long()
        model(input_ids=prefix_ids.to(device), attention_mask=prefix_attention.to(device), past_key_values=cache,
              use_cache=True, logits_to_keep=1)  # the prompts' own logits are never used
        cache.reorder_cache(owner.to(device))  # each row's prompt (index_select: gradients sum back)
        # Pass 2: from each row's last prompt token to its end, right-padded.
        suffix_width = int((ends - starts).max()) + 1
        offsets = torch.arange(suffix_width)
        positions = (starts - 1)[:, None] + offsets[None, :]  # each token's position in its row
        suffix_ids = batch.input_ids[rows[:, None], positions.clamp(max=batch.input_ids.shape[1] - 1)]
        suffix_ids = suffix_ids.masked_fill(positions >= ends[:, None], 0)
        # [n, 1, suffix, prefix + suffix]: the row's own prompt (no other prompt's, no
        # padding), then causal over its own suffix (a padding query sees earlier padding:
        # never an empty row, whose softmax would be NaN).
        sees_prefix = torch.arange(prefix_width)[None, :] < prefix_lengths[owner][:, None]
        sees = torch.cat([sees_prefix[:, None, :].expand(-1, suffix_width, -1),
                          (offsets[None, :] <= offsets[:, None])[None].expand(len(rows), -1, -1)], dim=2)
        dtype = compute_dtype(self.cfg)
        mask = torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, torch.finfo(dtype).min)[:, None]
        logits = model(input_ids=suffix_ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                       past_key_values=cache).logits
        suffix_logp, suffix_entropy = token_logprobs(logits, suffix_ids.to(device), batch.temperature, entropy,
                                                     self.cfg.learner.logit_chunk_tokens)
        # Back to the rows' layout: suffix token t sits at position start - 1 + t (padding
        # lands past each row's end, in room cut off after).
        index = positions.to(device)

        def placed(values: torch.Tensor) -> torch.Tensor:
            return values.new_zeros(len(rows), width + suffix_width).scatter(1, index, values)[:, :width]

        positions = len(distinct) * prefix_width + len(rows) * suffix_width
        tokens = int(prefix_lengths.sum() + (ends - starts + 1).sum())
        return Pass(placed(suffix_logp), placed(suffix_entropy) if suffix_entropy is not None else None, width, dummy,
                    positions, tokens)

    def micro_chunks(self, batch: TrainBatch, shares: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of a mini-batch in micro-batches; every rank gets the same count
        (a rank with fewer runs empty ones: dummy passes in the gradient collectives).

        `learner.micro_batch_tokens` > 0: chunks of rows of like length, at most that many
        padded tokens each (`token_budget_batches`); else about `micro_batch_size` rows each,
        whole questions ordered by their longest answer (`questions_by_length`)."""
        budget = self.cfg.learner.micro_batch_tokens
        if budget:
            per_rank = [token_budget_batches(rows, batch.lengths, budget) for rows in shares]
            mine = per_rank[self.rank]
            return mine + [mine[0][:0] if mine else shares[self.rank]] * (max(1, *map(len, per_rank)) - len(mine))
        count = max(1, max(math.ceil(len(r) / self.cfg.learner.micro_batch_size) for r in shares))
        return questions_by_length(shares[self.rank], batch.prompt_index, batch.lengths, count)

    @torch.no_grad()
    def old_logprobs(self, batch: TrainBatch, shares: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, [n, L] log-probs) of this rank's share under the current weights, in the
        order its micro-batches took the rows."""
        chunks = self.micro_chunks(batch, shares)
        rows = torch.cat(chunks)
        out = torch.zeros(len(rows), batch.input_ids.shape[1])
        position = 0
        self.sharding.model.eval()
        for chunk in chunks:
            run = self(batch, chunk, "none")
            if not run.dummy:
                out[position : position + len(chunk), :run.width] = run.logp.cpu()
                position += len(chunk)
        self.after_pass_without_graph()
        return rows, out

    @torch.no_grad()
    def mean_entropies(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, [n] mean token entropy of each row over its own response tokens) for this
        rank's share of `batch`'s rows (each row a question of its own); reduced here, so only
        n numbers travel back."""
        shares = rows_per_rank(batch.prompt_index, range(batch.num_prompts), self.world_size)
        means = []
        self.sharding.model.eval()
        chunks = self.micro_chunks(batch, shares)
        for chunk in chunks:
            run = self(batch, chunk, "detached")
            if not run.dummy:
                mask = batch.response_mask[chunk, :run.width].to(self.device)
                means.append(((run.entropy * mask).sum(-1) / mask.sum(-1).clamp_min(1)).cpu())
        self.after_pass_without_graph()
        return torch.cat(chunks), torch.cat(means) if means else torch.zeros(0)

    def after_pass_without_graph(self) -> None:
        """Back to training mode, and FSDP2's root sharded again: FSDP2 keeps the root's
        parameters (the embedding and the head) gathered after its forward, for the backward
        it expects; a pass without one leaves them whole on every rank, in memory and in
        `named_parameters` (a checkpoint would gather whole tensors), until a backward comes."""
        model = self.sharding.model
        model.train()
        if hasattr(model, "reshard"):  # (FSDP2's `FSDPModule`; not recursive: the layers reshard themselves)
            model.reshard()
