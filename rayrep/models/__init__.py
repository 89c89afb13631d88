"""The policy: the embedded tiny model, or any Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

from rayrep.config import Config, ConfigError


def tiny_spec(cfg: Config):
    """The tiny policy's build recipe: its size and warm start from `model.tiny_*`, its task
    (levels, seed) from `data`. The run's train and test sizes do not enter: train splits
    are prefixes of one sequence and test problems are never in one (see make_splits)."""
    from rayrep.models.tiny import TinyPolicySpec

    hidden = cfg.model.tiny_hidden_size
    if hidden % 32:
        raise ConfigError(f"model.tiny_hidden_size: {hidden} must be a multiple of 32 (the head size)")
    return TinyPolicySpec(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_layers=cfg.model.tiny_layers,
        num_heads=hidden // 32,
        num_kv_heads=max(1, hidden // 64),
        levels=cfg.data.arithmetic_levels,
        num_train=cfg.model.tiny_warm_start_problems,
        task_seed=cfg.data.arithmetic_seed,
        warm_start_steps=cfg.model.tiny_warm_start_steps,
        warm_start_slips=cfg.model.tiny_warm_start_slips,
        warm_start_slip_steps=cfg.model.tiny_warm_start_slip_steps,
    )


def resolve_policy(cfg: Config, log=print) -> str:
    """Path (or hub id) of the base policy; builds the tiny policy on first use."""
    if cfg.model.path != "tiny":
        return cfg.model.path
    from rayrep.models.tiny import ensure_tiny_policy

    cache = Path(cfg.model.cache_dir) if cfg.model.cache_dir else None
    return str(ensure_tiny_policy(tiny_spec(cfg), cache, log=log))
