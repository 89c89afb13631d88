"""The algorithms: what enters and leaves the replay buffer and how groups are formed."""

from __future__ import annotations

from rayrep.config import Config


def make_algorithm(cfg: Config, prompts: list, prompt_ids: dict):
    """The algorithm named by `algorithm.name`. Its inputs (an experience pool, for RLEP)
    are read and checked here, before any actor starts."""
    name = cfg.algorithm.name
    if name == "grpo":
        from rayrep.algos.grpo import GRPO

        return GRPO(cfg)
    if name == "rlep":
        from rayrep.algos.rlep import RLEP

        return RLEP(cfg, prompt_ids)
    if name == "exgrpo":
        from rayrep.algos.exgrpo import ExGRPO

        return ExGRPO(cfg, prompts)
    raise ValueError(f"unknown algorithm {name!r}")
