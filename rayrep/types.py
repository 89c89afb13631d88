"""The few data contracts that cross component boundaries.

A field exists only when something reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Prompt:
    """One question of a prompt set, whatever file or generator it came from.

    `messages` is a chat list (`[{"role": "user", "content": ...}]`); a prompt given as a
    plain string becomes one user message, so every model renders prompts the same way,
    through its tokenizer's chat template.
    """

    uid: str
    """Stable question id: the replay buffer's key and the shard routing key."""
    messages: tuple[dict, ...]
    ground_truth: str
    """Reference answer the verifier compares the completion's final answer against."""
    data_source: str = "unknown"
    extra: dict = field(default_factory=dict, compare=False)
    """Row fields kept for the user (`extra_info`, `ability`); nothing in rayrep reads them."""

    @property
    def text(self) -> str:
        """The last user message: the question itself, for logs and plots."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


@dataclass
class Rollout:
    """One sampled answer, as a generator returns it."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """Behaviour policy's log-prob of each response token (same length as response_ids)."""
    text: str
    finish_reason: str
    """'stop' (the policy ended its answer) or 'length' (cut at the response limit)."""
    version: int = 0
    """Policy version (number of weight syncs) of the weights that sampled it."""


@dataclass
class TrainBatch:
    """What the learner trains on: per-token tensors, nothing algorithm-specific.

    N sequences (prompt + response, right-padded to length L). Token t of a row is
    predicted from tokens < t; per-token tensors are indexed by the predicted token.
    """

    input_ids: "torch.Tensor"
    """[N, L] int64: prompt then response token ids, right-padded."""
    lengths: "torch.Tensor"
    """[N] int64: prompt + response length of each row (positions >= length are padding)."""
    response_mask: "torch.Tensor"
    """[N, L] bool: position t holds a response token that the loss trains on."""
    old_logprobs: "torch.Tensor"
    """[N, L] float32: log-prob of token t under the behaviour policy (response positions)."""
    recompute_old: "torch.Tensor"
    """[N] bool: the learner replaces these rows' old log-probs with its own before updating."""
    advantages: "torch.Tensor"
    """[N] float32: one advantage per sequence."""
    replay_mask: "torch.Tensor"
    """[N] bool: replayed answer (from the buffer), not a fresh rollout."""
    prompt_index: "torch.Tensor"
    """[N] int64: question of each row; a mini-batch takes whole questions."""
    temperature: float = 1.0
    """Sampling temperature of the behaviour policy; the learner scales its logits to match."""

    @property
    def num_prompts(self) -> int:
        return int(self.prompt_index.max()) + 1 if len(self.prompt_index) else 0


@dataclass(frozen=True)
class LossSpec:
    """How the learner turns log-probs into a loss (see `rayrep.learner.loss.policy_loss`)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 10.0
    agg: str = "token-mean"
    norm_constant: float | None = None
    clip: bool = True
    """Clip fresh tokens (ExGRPO's mixed phase turns this off)."""
    replay_shaping: bool = False
    """Replayed tokens use f(w) = w / (w + beta) instead of the clipped ratio (ExGRPO)."""
    replay_beta: float = 0.1
    entropy_coef: float = 0.0


@dataclass
class Group:
    """One question's answers for one training step: fresh rollouts and any replayed ones."""

    prompt: Prompt
    rollouts: list[Rollout]
    correct: list[bool]
    replayed: list[bool]
    """Per answer: drawn from the replay buffer rather than sampled this step."""
    rewards: list[float] = field(default_factory=list)
    """Filled by the algorithm (verifier reward plus shaping)."""

    @property
    def size(self) -> int:
        return len(self.rollouts)
