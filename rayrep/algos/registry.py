"""The registry of the algorithms (`interface.Algorithm`; GRPO, RLEP, ExGRPO, answer-level
Prioritized replay), the one place that maps `algorithm.name` to code. Each is built in two
moves: what can be wrong with its inputs is read and checked before any actor starts
(`check_inputs`), then it is built whole, with the run's replay buffer and learners
(`make_algorithm`).

A new algorithm is a class beside these (usually a subclass of `GRPO`, overriding what it
changes and saying what it needs: `replays`, `check_inputs`, `create`; its draw from the
replay store, if it has one, in `rayrep.algos.sampling`), its entry in `ALGORITHMS`, and its name among `algorithm.name`'s choices (with its settings section, if it
has one, in `rayrep.config.schema`)."""

from __future__ import annotations

from rayrep.algos.exgrpo import ExGRPO
from rayrep.algos.grpo import GRPO
from rayrep.algos.interface import Algorithm, AlgorithmInputs
from rayrep.algos.prioritized import Prioritized
from rayrep.algos.rlep import RLEP
from rayrep.buffer.answers import Origin
from rayrep.buffer.replay import ReplayStore
from rayrep.config import Config, ConfigError
from rayrep.data import PromptSampler
from rayrep.learner.group import LearnerGroup
from rayrep.types import Prompt

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmInputs", "algorithm_class", "check_inputs", "make_algorithm"]

ALGORITHMS: dict[str, type[GRPO]] = {algorithm.name: algorithm for algorithm in (GRPO, RLEP, ExGRPO, Prioritized)}
"""Every algorithm a run can train with, by `algorithm.name`."""


def algorithm_class(cfg: Config) -> type[GRPO]:
    """The class of the algorithm `algorithm.name` names: what it needs is asked of it."""
    try:
        return ALGORITHMS[cfg.algorithm.name]
    except KeyError:
        raise ConfigError(f"algorithm.name: {cfg.algorithm.name!r} is not one of {', '.join(map(repr, ALGORITHMS))}") from None


def check_inputs(cfg: Config, prompts: list[Prompt], prompt_ids: dict[str, list[int]],
                 origin: Origin = Origin()) -> AlgorithmInputs:
    """Read and check what the algorithm named by `algorithm.name` is built from (RLEP's pool
    against this run's prompt tokens, ExGRPO's settings): an error before anything starts."""
    return algorithm_class(cfg).check_inputs(cfg, AlgorithmInputs(prompts, prompt_ids, origin=origin))


def make_algorithm(cfg: Config, inputs: AlgorithmInputs, buffer: ReplayStore | None,
                   learners: LearnerGroup | None, sampler: PromptSampler) -> Algorithm:
    """The algorithm, whole: RLEP's pool goes into the buffer's shards now; ExGRPO retires
    questions from `sampler`, the run's training set."""
    return algorithm_class(cfg).create(cfg, inputs, buffer, learners, sampler)
