"""Prompt sets: files in the verl/DAPO row format, or the embedded arithmetic task."""

from __future__ import annotations

from typing import Literal

from rayrep.config import DataConfig, InputError
from rayrep.types import Prompt


class PromptTooLong(InputError):
    """A prompt renders to more tokens than `data.max_prompt_tokens`."""


def load_split(data: DataConfig, split: Literal["train", "test"]) -> list[Prompt]:
    """The prompts of a split: from `data.<split>_files`, else the embedded task."""
    files = data.train_files if split == "train" else data.test_files
    if not files:
        from rayrep.data.arithmetic import arithmetic_prompts

        return arithmetic_prompts(
            split, data.arithmetic_train_size, data.arithmetic_test_size, data.arithmetic_seed, data.arithmetic_levels,
            data.arithmetic_test_reserve,
        )
    from rayrep.data.loaders import PromptFileError, load_prompts

    prompts, origin = [], {}
    for path in files:
        for prompt in load_prompts(path):
            if prompt.uid in origin:
                raise PromptFileError(f"{path}: question id {prompt.uid!r} also appears in {origin[prompt.uid]}")
            origin[prompt.uid] = path
            prompts.append(prompt)
    return prompts


def encode_prompts(tokenizer, prompts: list[Prompt], max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt rendered with the policy's chat template."""
    encoded = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if len(ids) > max_tokens:
            raise PromptTooLong(
                f"question {prompt.uid!r} ({prompt.data_source}) has {len(ids)} prompt tokens, "
                f"more than data.max_prompt_tokens={max_tokens}"
            )
        encoded.append(list(ids))
    return encoded


class PromptSampler:
    """Training questions in epochs, each epoch in a fresh seeded order."""

    def __init__(self, prompts: list[Prompt], seed: int = 0):
        if not prompts:
            raise ValueError("the training prompt set is empty")
        self.prompts, self.seed = prompts, seed
        self.epoch, self.order, self.position = 0, [], 0
        self._shuffle()

    def _shuffle(self) -> None:
        import random

        self.order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(self.order)
        self.position = 0

    def state(self) -> dict:
        """Where the sampler is (the order of an epoch follows from the seed and the epoch)."""
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self._shuffle()
        self.position = state["position"]

    def next(self, count: int) -> list[Prompt]:
        batch = []
        while len(batch) < count:
            if self.position == len(self.order):
                self.epoch += 1
                self._shuffle()
            batch.append(self.prompts[self.order[self.position]])
            self.position += 1
        return batch
