"""The few data contracts that cross component boundaries.

A field exists only when something reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
