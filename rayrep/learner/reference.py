"""The reference policy of the KL penalty (`learner.kl.coef`): the run's starting policy
(`model.path`), frozen, whose log-probs of every answer's tokens the learners compute before
an update, as they do the old log-probs.

Its weights live where the policy's do, in the compute dtype and without gradients, optimizer
state or fp32 masters: FSDP2 shards them over the ranks as it shards the policy (one fp32 rank
holds them whole, as it does the policy), DeepSpeed ZeRO-2 holds them whole on every rank as it
does the policy's compute copy; where the roles take turns on a GPU they leave it and come back
with the optimizer state, which only an update needs too (`LearnerWorker._move`; DeepSpeed's own
state stays, the reference moves all the same). The memory plan counts them
(`rayrep.cluster.memory.REFERENCE`).

With LoRA the reference is the frozen base itself: the same weights with the adapter switched
off for the pass (PEFT's `enable_adapters`), so it costs no memory at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from rayrep.config import Config
from rayrep.learner.forward import PolicyForward, rows_per_rank
from rayrep.learner.sharding import Sharding, compute_dtype, fsdp2_shards, shard_layers
from rayrep.types import TrainBatch

__all__ = ["FrozenPolicy", "Reference"]


@dataclass
class FrozenPolicy:
    """A policy that only runs forward passes: what `PolicyForward` reads of a `Sharding`."""

    model: torch.nn.Module
    module: torch.nn.Module
    whole_parameters: bool

    @classmethod
    def load(cls, model_path: str, cfg: Config, world_size: int, device: torch.device, overrides: dict) -> FrozenPolicy:
        """`model_path`'s policy in the compute dtype, frozen, sharded as the policy is: over the
        ranks by FSDP2 (several ranks, or a bf16 one), else whole on this rank."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=compute_dtype(cfg), **overrides)
        model.config.use_cache = False
        model.requires_grad_(False)
        model.eval()
        shards = fsdp2_shards(cfg, world_size)
        if shards:
            shard_layers(model, world_size, device)
        else:
            model.to(device)
        return cls(model=model, module=model, whole_parameters=not shards)

    def nbytes(self) -> int:
        """What this rank holds of it."""
        return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in self.model.parameters())


@contextmanager
def adapter_switched_off(module: torch.nn.Module) -> Iterator[None]:
    """The LoRA layers of `module` compute the base layer alone inside (PEFT's public switch
    on each adapter layer; switched back on after, their adapter training again)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [layer for layer in module.modules() if isinstance(layer, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class Reference:
    """The reference policy's log-probs over one rank's rows of a batch."""

    def __init__(self, cfg: Config, policy: Sharding | FrozenPolicy, device: torch.device, rank: int,
                 world_size: int, lora: bool):
        self.forward = PolicyForward(cfg, policy, device, rank, world_size)
        self.policy, self.lora = policy, lora

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, steps: list[range]) -> torch.Tensor:
        """[N, L] the reference's log-prob of each token of this rank's rows of the mini-batches
        `steps` (zeros elsewhere); every rank calls it together (FSDP2 gathers in each pass)."""
        out = torch.zeros(batch.input_ids.shape)
        switch = adapter_switched_off(self.policy.module) if self.lora else nullcontext()
        with switch:
            for prompts in steps:
                rows, values = self.forward.old_logprobs(batch, rows_per_rank(batch.prompt_index, prompts,
                                                                              self.forward.world_size))
                out[rows] = values
        return out
