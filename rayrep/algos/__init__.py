"""The algorithms: step functions over values (see `rayrep.algos.grpo` for the interface),
and what enters and leaves the replay buffer."""

from __future__ import annotations

from rayrep.algos.grpo import GRPO
from rayrep.config import Config
from rayrep.types import Prompt


def make_algorithm(cfg: Config, prompts: list[Prompt], prompt_ids: dict[str, list[int]]) -> GRPO:
    """The algorithm named by `algorithm.name`. Its inputs (an experience pool, for RLEP)
    are read and checked here, before any actor starts."""
    name = cfg.algorithm.name
    if name == "grpo":
        return GRPO(cfg)
    if name == "rlep":
        from rayrep.algos.rlep import RLEP

        return RLEP(cfg, prompt_ids)
    if name == "exgrpo":
        from rayrep.algos.exgrpo import ExGRPO

        return ExGRPO(cfg, prompts, prompt_ids)
    raise ValueError(f"unknown algorithm {name!r}")
