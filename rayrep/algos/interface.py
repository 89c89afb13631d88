"""What the loop asks of an algorithm: a few step functions over values, and its own state.

- `plan(sampler, questions, exclude, version) -> StepPlan`: which questions to roll out, how
  many fresh rollouts each, and which stored answers join which group (or are left to
  choose), at the generators' policy version;
- `join_replays(groups) -> (groups, metrics)`: once the learners hold the GPUs, the answers
  left to choose join their groups;
- `build(groups, dropped, step=) -> StepBatch`: the verified groups scored, their
  advantages, the learner's batch (in the step's own order) and the loss to train it with
  (pure);
- `after_update(step, batch) -> metrics`: what enters and leaves the replay buffer;
- `state()` / `load_state(state)`: what a resumed run needs besides the buffer (JSON values).

Nothing one of them needs from another travels in an attribute: it is in the plan or the
batch. `rayrep.algos.grpo.GRPO` is the baseline implementation; RLEP and ExGRPO extend it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rayrep.data import PromptSampler
from rayrep.types import Group, StepBatch, StepPlan


class Algorithm(Protocol):
    name: str

    def plan(self, sampler: PromptSampler, questions: int, exclude: frozenset[str] = frozenset(),
             version: int = 0) -> StepPlan: ...

    def join_replays(self, groups: Sequence[Group]) -> tuple[list[Group], dict[str, float]]: ...

    def build(self, groups: Sequence[Group], dropped: Sequence[Group] = (), *, step: int) -> StepBatch: ...

    def after_update(self, step: int, batch: StepBatch) -> dict[str, float]: ...

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...
