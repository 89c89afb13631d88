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

And, as a class, what the run around it needs to know (the registry, `rayrep.algos.registry.ALGORITHMS`,
asks only these): `replays` (the run keeps a replay buffer), `label`, `pool_from_baseline`
(the comparison pipeline samples a pool from the baseline first), `check_inputs` (its inputs
read and checked before any actor starts) and `create` (built whole, with the run's parts).

Nothing one of them needs from another travels in an attribute: it is in the plan or the
batch. `rayrep.algos.grpo.GRPO` is the baseline implementation; RLEP and ExGRPO extend it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from rayrep.buffer.answers import Origin
from rayrep.config import Config
from rayrep.data import PromptSampler
from rayrep.types import Group, Prompt, StepBatch, StepPlan


@dataclass(frozen=True)
class AlgorithmInputs:
    """An algorithm's inputs, read and checked: the training questions, their prompt tokens,
    what its `check_inputs` read (RLEP's experience pool; none where the run attaches to a
    shared pool), and who samples the run's answers (`Origin`: what they carry into a
    replay buffer)."""

    prompts: list[Prompt]
    prompt_ids: dict[str, list[int]]
    pool: object = None
    """What the algorithm's `check_inputs` read for it (RLEP: its `ExperiencePool`), or None."""
    origin: Origin = Origin()


class Algorithm(Protocol):
    name: ClassVar[str]
    label: ClassVar[str]
    replays: ClassVar[bool]
    pool_from_baseline: ClassVar[bool]

    @classmethod
    def check_inputs(cls, cfg: Config, inputs: AlgorithmInputs) -> AlgorithmInputs: ...

    @classmethod
    def create(cls, cfg: Config, inputs: AlgorithmInputs, buffer, learners, sampler: PromptSampler) -> "Algorithm": ...

    def plan(self, sampler: PromptSampler, questions: int, exclude: frozenset[str] = frozenset(),
             version: int = 0) -> StepPlan: ...

    def join_replays(self, groups: Sequence[Group]) -> tuple[list[Group], dict[str, float]]: ...

    def build(self, groups: Sequence[Group], dropped: Sequence[Group] = (), *, step: int) -> StepBatch: ...

    def after_update(self, step: int, batch: StepBatch) -> dict[str, float]: ...

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...
