"""Prompt sets: files in the verl/DAPO row format, or the embedded arithmetic task."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from rayrep.config import Config, DataConfig, InputError
from rayrep.data.pruner import GenerationPruner
from rayrep.types import Group, Prompt


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
    """Training questions in epochs, each epoch in a fresh seeded order.

    Questions can be retired (ExGRPO: every answer right): they stay in the epoch under way
    and are left out of the following ones, unless that would leave fewer than
    `keep_at_least` questions (one step's batch), in which case the set stops shrinking (the
    public ExGRPO code stops filtering near one batch too).

    With a `pruner` (`rayrep.data.pruner`), the questions it says sit out are passed by and
    the next ones drawn in their place; the steps' verdicts reach it through `observe`."""

    def __init__(self, prompts: list[Prompt], seed: int = 0, keep_at_least: int = 1,
                 pruner: GenerationPruner | None = None):
        if not prompts:
            raise ValueError("the training prompt set is empty")
        self.prompts, self.seed, self.keep_at_least = prompts, seed, keep_at_least
        self.pruner = pruner
        self.retired: set[str] = set()
        self.left_out: frozenset[str] = frozenset()
        """The retired questions this epoch's order leaves out (those retired by its start)."""
        self.epoch, self.order, self.position = 0, [], 0
        self.returned: list[str] = []
        """Questions given back (`give_back`), drawn again before the order goes on."""
        self._shuffle()

    @classmethod
    def of_run(cls, cfg: Config, prompts: list[Prompt]) -> PromptSampler:
        """A training run's sampler: seeded by the run, never shrinking below a batch, with the
        pruner `algorithm.prune` asks for."""
        prune = cfg.algorithm.prune
        pruner = GenerationPruner(prune.after, prune.skip, prune.growth) if prune.after else None
        return cls(prompts, seed=cfg.seed("data"), keep_at_least=cfg.algorithm.prompts_per_step, pruner=pruner)

    def _shuffle(self) -> None:
        import random

        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        self.order = [i for i in order if self.prompts[i].uid not in self.left_out]
        self.position = 0

    def _next_epoch(self) -> None:
        self.epoch += 1
        if sum(p.uid not in self.retired for p in self.prompts) >= self.keep_at_least:
            self.left_out = frozenset(self.retired)
        self._shuffle()

    def retire(self, uids) -> None:
        """Leave `uids` out of every epoch that starts from now on."""
        self.retired.update(uids)

    @property
    def active(self) -> int:
        """How many questions the epoch under way visits."""
        return len(self.order)

    def state(self) -> dict:
        """Where the sampler is (the order of an epoch follows from the seed, the epoch and the
        questions it leaves out)."""
        state = {"epoch": self.epoch, "position": self.position, "retired": sorted(self.retired),
                 "left_out": sorted(self.left_out), "returned": list(self.returned)}
        if self.pruner is not None:
            state["pruner"] = self.pruner.state()
        return state

    def restore(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.retired = set(state.get("retired", ()))  # absent from checkpoints written before retirement
        self.left_out = frozenset(state.get("left_out", ()))
        self._shuffle()
        self.position = state["position"]
        self.returned = list(state.get("returned", ()))  # absent from checkpoints written before partial rollouts
        if self.pruner is not None and "pruner" in state:
            self.pruner.restore(state["pruner"])

    def give_back(self, uids) -> None:
        """Questions drawn but not trained on (partial rollouts stopped them at a checkpoint):
        the next draws take them first, in this order."""
        self.returned.extend(uids)

    def next(self, count: int) -> list[Prompt]:
        by_uid = {p.uid: p for p in self.prompts} if self.returned else {}
        batch = [by_uid[uid] for uid in self.returned[:count]]
        del self.returned[:count]
        passed = 0
        while len(batch) < count:
            if self.position == len(self.order):
                self._next_epoch()
            prompt = self.prompts[self.order[self.position]]
            self.position += 1
            # Never more than a whole epoch passed by in one draw: with every question sitting
            # out, the draw takes them as they come (a pause cannot stop training).
            if self.pruner is not None and passed < len(self.order) and self.pruner.passes_by(prompt.uid):
                passed += 1
                continue
            batch.append(prompt)
        return batch

    def observe(self, groups: Sequence[Group]) -> dict[str, float]:
        """A step's verified groups, for the pruner (their fresh answers' verdicts); its counts
        as step metrics (none without a pruner)."""
        if self.pruner is None:
            return {}
        self.pruner.observe((g.prompt.uid, [a.correct for a in g.fresh()]) for g in groups if not all(g.replayed))
        return self.pruner.take_counts()
