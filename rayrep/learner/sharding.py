"""How a learner rank shards the policy and applies its gradients: FSDP2 or DeepSpeed ZeRO-2.

Both give the worker the same things, so the training loop is written once: `model`
(call it, `.train()`/`.eval()` it), `module` (the Hugging Face model inside, for names
and global shapes), `backward(loss, last_micro_batch)`,
`step() -> (grad_norm, stepped)` and `full_tensors()` (every rank iterates together).
Gradients are averaged over ranks by both; the worker's loss is already a global mean,
so it scales by the world size before `backward`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Protocol

import torch

from rayrep.config import Config


class Sharding(Protocol):
    """What a learner rank needs of a sharding strategy; the worker's loop is written once against it."""

    model: torch.nn.Module
    """The module to call (and `.train()` / `.eval()`): the sharded model or its engine."""
    module: torch.nn.Module
    """The Hugging Face model inside, for parameter names and global shapes."""

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Accumulate the gradient of `loss`; reduce across ranks on a mini-batch's last micro-batch."""

    def step(self) -> tuple[float, bool]:
        """Clip and apply the accumulated gradient: (global grad norm, whether the step was applied)."""

    def last_lr(self) -> float:
        """The learning rate the next `step` applies."""

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every parameter; every rank must iterate together."""


def make_optimizer(model: torch.nn.Module, cfg: Config, total_optimizer_steps: int):
    """AdamW with linear warm-up, then a constant or cosine learning rate."""
    learner = cfg.learner
    optimizer = torch.optim.AdamW(model.parameters(), lr=learner.lr, weight_decay=learner.weight_decay, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda=lambda step: lr_factor(step, learner.warmup_steps, total_optimizer_steps, learner.lr_schedule)
    )
    return optimizer, scheduler


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warm-up over `warmup` optimizer steps, then constant or cosine decay to 0 at `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


class FSDP2Sharding:
    """Parameters, gradients and optimizer state sharded with `fully_shard` (per layer and root)."""

    def __init__(self, model: torch.nn.Module, cfg: Config, world_size: int, device: torch.device, total_optimizer_steps: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = self.module = model
        self.optimizer, self.scheduler = make_optimizer(model, cfg, total_optimizer_steps)
        self.grad_clip = cfg.learner.grad_clip
        self.skip_above = cfg.learner.skip_grad_norm_above

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        # Reduce-scatter gradients once per mini-batch, on its last micro-batch.
        self.model.set_requires_gradient_sync(last_micro_batch)
        loss.backward()

    def step(self) -> tuple[float, bool]:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or float("inf"))
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        stepped = math.isfinite(grad_norm) and not (self.skip_above and grad_norm > self.skip_above)
        if stepped:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    def last_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            yield name, full.detach()


class DeepSpeedSharding:
    """DeepSpeed ZeRO stage 2: gradients and optimizer state sharded, parameters whole on every rank.

    The worker has already joined the process group, so DeepSpeed reuses it. Our own
    scheduler drives the learning rate (the same schedule as FSDP2), and each mini-batch's
    micro-batches accumulate with `scale_wrt_gas=False`: the loss is already normalised.
    A step whose gradient norm is not finite is skipped by DeepSpeed itself.
    """

    def __init__(self, model: torch.nn.Module, cfg: Config, world_size: int, device: torch.device, total_optimizer_steps: int):
        # Ray gives each learner actor its own device, so the local rank is always 0; the
        # accelerator follows the configured device, not whatever DeepSpeed detects.
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ["DS_ACCELERATOR"] = "cuda" if device.type == "cuda" else "cpu"
        import deepspeed

        optimizer, self.scheduler = make_optimizer(model, cfg, total_optimizer_steps)
        config = {
            "train_micro_batch_size_per_gpu": 1,  # unused: the worker forms its own micro-batches
            "gradient_accumulation_steps": 1,  # the worker marks accumulation boundaries itself
            "gradient_clipping": cfg.learner.grad_clip,
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,  # torch AdamW
            "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
            "fp16": {"enabled": cfg.model.dtype == "float16"},
            "steps_per_print": 2**62,
        }
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )
        self.module = self.model.module

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        self.model.set_gradient_accumulation_boundary(last_micro_batch)
        self.model.backward(loss, scale_wrt_gas=False)

    def step(self) -> tuple[float, bool]:
        self.model.step()
        # Computed on every step (we never turn `compute_grad_norm` off); inf when DeepSpeed
        # found a non-finite gradient and skipped the step.
        grad_norm = float(self.model.get_global_grad_norm())
        self.scheduler.step()
        return grad_norm, math.isfinite(grad_norm)

    def last_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            yield name, param.detach()


def make_sharding(
    strategy: str, model: torch.nn.Module, cfg: Config, world_size: int, device: torch.device, total_optimizer_steps: int
) -> Sharding:
    kinds: dict[str, type[Sharding]] = {"fsdp2": FSDP2Sharding, "deepspeed": DeepSpeedSharding}
    return kinds[strategy](model, cfg, world_size, device, total_optimizer_steps)
