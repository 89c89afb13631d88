"""The algorithms (`interface.Algorithm`; GRPO, RLEP, ExGRPO), built in two moves: what can
be wrong with their inputs is read and checked before any actor starts (`check_inputs`),
then each is built whole, with the run's replay buffer and learners (`make_algorithm`)."""

from __future__ import annotations

from dataclasses import dataclass

from rayrep.algos.exgrpo import ExGRPO, check_exgrpo_settings
from rayrep.algos.grpo import GRPO
from rayrep.algos.interface import Algorithm
from rayrep.algos.rlep import RLEP, ExperiencePool, load_pool
from rayrep.buffer.answers import Origin
from rayrep.buffer.replay import ReplayBuffer
from rayrep.config import Config
from rayrep.data import PromptSampler
from rayrep.learner.group import LearnerGroup
from rayrep.types import Prompt


@dataclass(frozen=True)
class AlgorithmInputs:
    """An algorithm's inputs, read and checked: the training questions, their prompt tokens,
    RLEP's experience pool (none where the run attaches to a shared pool), and who samples
    the run's answers (`Origin`: what they carry into a replay buffer)."""

    prompts: list[Prompt]
    prompt_ids: dict[str, list[int]]
    pool: ExperiencePool | None = None
    origin: Origin = Origin()


def check_inputs(cfg: Config, prompts: list[Prompt], prompt_ids: dict[str, list[int]],
                 origin: Origin = Origin()) -> AlgorithmInputs:
    """Read and check what the algorithm named by `algorithm.name` is built from (RLEP's pool
    against this run's prompt tokens, ExGRPO's settings): an InputError before anything starts."""
    name = cfg.algorithm.name
    if name == "rlep" and not cfg.replay.pool:
        return AlgorithmInputs(prompts, prompt_ids, load_pool(cfg, prompt_ids), origin)
    if name == "exgrpo":
        check_exgrpo_settings(cfg)
    return AlgorithmInputs(prompts, prompt_ids, origin=origin)


def make_algorithm(cfg: Config, inputs: AlgorithmInputs, buffer: ReplayBuffer | None,
                   learners: LearnerGroup | None, sampler: PromptSampler) -> Algorithm:
    """The algorithm, whole: RLEP's pool goes into the buffer's shards now; ExGRPO retires
    questions from `sampler`, the run's training set."""
    name = cfg.algorithm.name
    if name == "grpo":
        return GRPO(cfg)
    if name == "rlep":
        return RLEP(cfg, inputs.prompt_ids, inputs.pool, buffer, inputs.origin)
    if name == "exgrpo":
        return ExGRPO(cfg, inputs.prompts, inputs.prompt_ids, buffer, learners, sampler, inputs.origin)
    raise ValueError(f"unknown algorithm {name!r}")
