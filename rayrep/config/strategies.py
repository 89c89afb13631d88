"""What each learner sharding strategy (`learner.strategy`) can do, asked wherever a run
depends on it: the config's rules, the memory plan, checkpoints and resume, the learner's
moves on shared GPUs. The code that shards is `rayrep.learner.sharding`; a new strategy is
a class there and its entry here, and nothing else compares its name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardingStrategy:
    name: str
    shards_parameters: bool
    """Each rank holds its shard of the parameters (FSDP2, gathering each layer's for its
    forward); else the whole compute-dtype model on every rank beside its fp32 partition
    (DeepSpeed ZeRO-2 shards the optimizer state and gradients only)."""
    state_moves: bool
    """Its parameters and optimizer state leave the GPU for host memory while colocated
    engines sample; else they stay on the GPU for the whole run, from its set-up on."""
    resumable: bool
    """A run's checkpoints keep its optimizer state, so the run can resume."""
    skips_large_gradients: bool
    """It can skip an update whose gradient norm is above `learner.skip_grad_norm_above`
    (DeepSpeed skips only non-finite steps)."""


SHARDING_STRATEGIES: dict[str, ShardingStrategy] = {strategy.name: strategy for strategy in (
    ShardingStrategy("fsdp2", shards_parameters=True, state_moves=True, resumable=True, skips_large_gradients=True),
    ShardingStrategy("deepspeed", shards_parameters=False, state_moves=False, resumable=False,
                     skips_large_gradients=False),
)}
"""Every `learner.strategy`, by name."""
