"""How a learner rank shards the policy and applies its gradients: FSDP2 or DeepSpeed ZeRO-2,
or, for a single fp32 rank, nothing at all (`OneRank`).

Both give the worker the same things, so the training loop is written once: `model`
(call it, `.train()`/`.eval()` it), `module` (the Hugging Face model inside, for names
and global shapes), `backward(loss, last_micro_batch)`,
`step() -> (grad_norm, stepped)`, `full_tensors()` (every rank iterates together) and
`full_state(dtype, rank)` (the checkpoint's weights, gathered in CPU memory).
Gradients are averaged over ranks by both; the worker's loss is already a global mean,
so it scales by the world size before `backward`.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from rayrep.config import Config


class Sharding(Protocol):
    """What a learner rank needs of a sharding strategy; the worker's loop is written once against it.

    Parameters and optimizer state are fp32 (the master weights); forward and backward
    run in `model.dtype` (bf16 on the paper presets), gradients are reduced in fp32.
    """

    model: torch.nn.Module
    """The module to call (and `.train()` / `.eval()`): the sharded model or its engine."""
    whole_parameters: bool
    """Whether every parameter is whole on this rank while the model runs, so that a
    micro-batch may take several forward calls that share tensors before its backward
    (the learner's shared prompts). FSDP2 regathers each layer per call and frees it after,
    and a tensor carried from one call into the next (a prompt's keys and values) reaches
    backward with no hook of FSDP2's to gather that layer again."""
    module: torch.nn.Module
    """The Hugging Face model inside, for parameter names and global shapes."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """Counts rollout steps (the worker steps it once per `update`), not optimizer steps."""

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Accumulate the gradient of `loss`; reduce across ranks on a mini-batch's last micro-batch."""

    def step(self) -> tuple[float, bool]:
        """Clip and apply the accumulated gradient: (global grad norm, whether the step was applied)."""

    def full_tensors(self, dtype: torch.dtype | None = None, trained_only: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every parameter (`trained_only`: of those that train, a LoRA
        adapter's): the fp32 master, or in `dtype` (a weight sync's compute dtype); every rank
        must iterate together."""

    def full_state(self, dtype: torch.dtype, rank: int, trained_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Every parameter's (`trained_only`: every trained one's) full tensor in `dtype`, in
        CPU memory at rank 0 (None elsewhere); every rank must call it. For checkpoints: it
        takes no GPU memory."""


def make_optimizer(model: torch.nn.Module, cfg: Config):
    """AdamW over the fp32 parameters that train (all of them, or a LoRA adapter's), and its
    learning-rate schedule in ROLLOUT steps: linear warm-up, then constant or cosine decay to
    0 at `run.steps`. The RLEP code (a verl fork) steps its scheduler once per rollout, so
    the paper's 10 warm-up steps are 10 rollouts, however many optimizer steps each rollout
    takes."""
    learner = cfg.learner
    trained = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=learner.lr, weight_decay=learner.weight_decay, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda=lambda rollout: lr_factor(rollout, learner.warmup_steps, cfg.run.steps, learner.lr_schedule)
    )
    return optimizer, scheduler


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warm-up over `warmup` rollout steps, then constant or cosine decay to 0 at `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def compute_dtype(cfg: Config) -> torch.dtype:
    return getattr(torch, cfg.model.dtype)


def with_lora(model: torch.nn.Module, config, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with a LoRA adapter (`config`, a `peft.LoraConfig`) in each target layer, by
    PEFT, before any sharding: the adapter's parameters train, in fp32 (the masters, as a
    whole model's are); the base's are frozen and held in the compute `dtype`, with no
    gradients, optimizer state or fp32 masters (FSDP2 asks one dtype of the parameters that
    train only). The same module object: its parameters gain the adapter's, named by PEFT
    (`...q_proj.lora_A.default.weight`; the base's as `...q_proj.base_layer.weight`)."""
    from peft import get_peft_model

    get_peft_model(model, config)  # injects the adapter layers into `model` and freezes the rest
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(dtype)
    return model


def fsdp2_shards(cfg: Config, world_size: int) -> bool:
    """Whether FSDP2 shards a model over the ranks here: the strategy shards parameters, and
    this is not one fp32 rank (which holds the model whole: `OneRank`)."""
    return cfg.learner.sharding.shards_parameters and not (world_size == 1 and compute_dtype(cfg) == torch.float32)


def make_masters(module: torch.nn.Module) -> None:
    """The parameters of `module` that train, in fp32 (the optimizer's master weights), where
    the checkpoint stored them in another dtype: upcast in place, which is exact (bf16 to fp32
    gives the values an fp32 load of the same checkpoint gives; transformers computes the
    rotary `inv_freq` in fp32 under either load). Frozen ones (a LoRA base) stay as loaded;
    shards FSDP2 already made are fp32 and stay."""
    with torch.no_grad():
        for param in module.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()


def shard_layers(model: torch.nn.Module, world_size: int, device: torch.device, mp_policy=None,
                 masters: bool = False) -> None:
    """`fully_shard` on each decoder layer, then on the root, over all ranks; this rank's shards
    moved to `device`. `masters`: each layer's trained parameters upcast to fp32 just before
    it is sharded (`make_masters`), so that a rank holds the checkpoint's dtype, its fp32
    shards and one fp32 layer, never the whole policy in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    options = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.model.layers:
        if masters:
            make_masters(layer)
        fully_shard(layer, mesh=mesh, **options)
    if masters:
        make_masters(model)  # the embeddings, the head and the final norm
    fully_shard(model, mesh=mesh, **options)
    model.to(device)  # only this rank's shards move


class FSDP2Sharding:
    """Parameters, gradients and optimizer state sharded with `fully_shard` (per layer and root).

    Mixed precision: the sharded parameters stay fp32 (so are AdamW's moments); each
    all-gather casts them to the compute dtype for forward and backward, and gradients are
    reduce-scattered in fp32. At lr 1e-6 a bf16 parameter would round most updates away.
    """

    whole_parameters = False

    def __init__(self, model: torch.nn.Module, cfg: Config, world_size: int, device: torch.device):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        shard_layers(model, world_size, device,
                     MixedPrecisionPolicy(param_dtype=compute_dtype(cfg), reduce_dtype=torch.float32), masters=True)
        self.model = self.module = model
        self.world_size = world_size
        # Checkpoints gather the shards where they lie, in CPU memory while offloaded, which
        # NCCL cannot reach: a CPU group of the same ranks (on CPU runs, the default group).
        self.cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
        self.optimizer, self.scheduler = make_optimizer(model, cfg)
        self.grad_clip = cfg.learner.grad_clip
        self.skip_above = cfg.learner.skip_grad_norm_above

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        # Gradients are reduce-scattered after every micro-batch (FSDP2's default), each rank
        # accumulating its fp32 shard. With the sync off until the last micro-batch, every
        # rank would hold the whole model's unsharded fp32 gradients meanwhile (4 bytes a
        # parameter: 28 GiB for a 7B policy), which the memory plan has no room for. The
        # price: one reduce-scatter per micro-batch instead of one per mini-batch.
        loss.backward()

    def step(self) -> tuple[float, bool]:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or float("inf"))
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        stepped = math.isfinite(grad_norm) and not (self.skip_above and grad_norm > self.skip_above)
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    def full_tensors(self, dtype: torch.dtype | None = None, trained_only: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            if trained_only and not param.requires_grad:
                continue  # (on every rank alike: no all-gather of the frozen base)
            # Each rank casts its own shard, then the all-gather moves the cast tensors: a
            # bf16 sync gathers half the bytes of the fp32 masters (the same values: a cast
            # is elementwise).
            local = param.detach() if dtype is None else param.detach().to(dtype)
            yield name, local.full_tensor() if hasattr(local, "full_tensor") else local

    def full_state(self, dtype: torch.dtype, rank: int, trained_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Each parameter's (`trained_only`: each trained one's) dim-0 shards, cast to `dtype`
        where they lie (CPU memory while the engines hold the GPU), gathered to rank 0 over the
        CPU group and joined in rank order
        (FSDP2 shards dim 0 as torch.chunk does): a checkpoint never brings the learner's
        state back to the GPU."""
        W = self.world_size
        state: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if trained_only and not param.requires_grad:
                    continue
                local = _local(param).detach().to("cpu", dtype, copy=True)
                if W == 1:
                    state[name] = local
                    continue
                rows = [torch.zeros(1, dtype=torch.long) for _ in range(W)]
                dist.all_gather(rows, torch.tensor([local.shape[0]]), group=self.cpu_group)
                longest = max(int(r) for r in rows)
                padded = torch.zeros((longest, *local.shape[1:]), dtype=dtype)
                padded[: local.shape[0]] = local
                parts = [torch.empty_like(padded) for _ in range(W)] if rank == 0 else None
                dist.gather(padded, parts, dst=0, group=self.cpu_group)
                if rank == 0:
                    state[name] = torch.cat([part[: int(n)] for part, n in zip(parts, rows)]).view(param.shape)
        return state if rank == 0 else None


    # A learner checkpoint is one safetensors file per rank (this rank's shard of every fp32
    # master and AdamW moment: FSDP2 shards dim 0 as torch.chunk does) and the scheduler's
    # state; with LoRA, of the adapter's parameters only (the frozen base is the base policy's
    # own weights, loaded again on resume). Concatenating the files along dim 0 gives the full
    # tensors back, so a group of any size can load it; no pickle is involved.

    def save_state(self, folder: Path, rank: int, world_size: int) -> dict:
        """Write this rank's shards to `folder`; returns the small state every rank shares
        (per-parameter AdamW step counts, the scheduler), for the caller to write once."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tensors, steps = {}, {}
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            tensors[f"param/{name}"] = _local(param).detach().to("cpu", copy=True).contiguous()
            state = self.optimizer.state.get(param)
            if state:
                tensors[f"exp_avg/{name}"] = _local(state["exp_avg"]).to("cpu", copy=True).contiguous()
                tensors[f"exp_avg_sq/{name}"] = _local(state["exp_avg_sq"]).to("cpu", copy=True).contiguous()
                steps[name] = float(state["step"])
        save_file(tensors, folder / f"rank-{rank:05d}-of-{world_size:05d}.safetensors", metadata={"format": "pt"})
        return {"strategy": "fsdp2", "world_size": world_size, "adam_steps": steps,
                "scheduler": self.scheduler.state_dict()}

    def load_state(self, folder: Path, shared: dict) -> None:
        """Load a learner checkpoint written by a group of any size: each tensor is rebuilt
        whole in host memory from the old shards, one at a time, and this rank copies its own
        rows of it where its parameter lies (host memory while colocated engines hold the
        GPU); the optimizer state is made there too. Nothing whole reaches the device."""
        from safetensors import safe_open

        files = sorted(folder.glob("rank-*.safetensors"))
        if len(files) != shared["world_size"]:
            raise FileNotFoundError(f"{folder}: {len(files)} rank files, the checkpoint was written by "
                                    f"{shared['world_size']} learners")
        handles = [safe_open(str(f), framework="pt") for f in files]

        def rows_of(kind: str, name: str, like: torch.Tensor) -> torch.Tensor:
            """This rank's rows of the whole tensor (FSDP2 shards dim 0 as torch.chunk does)."""
            full = torch.cat([h.get_tensor(f"{kind}/{name}") for h in handles], dim=0)
            if not hasattr(like, "device_mesh"):
                return full
            per_rank = -(-full.shape[0] // like.device_mesh.size())
            start = like.device_mesh.get_local_rank() * per_rank
            return full[start : start + _local(like).shape[0]]

        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if not param.requires_grad:
                    continue
                _local(param).copy_(rows_of("param", name, param))
                if name in shared["adam_steps"]:
                    moments = {kind: torch.zeros_like(param) for kind in ("exp_avg", "exp_avg_sq")}
                    for kind, moment in moments.items():
                        _local(moment).copy_(rows_of(kind, name, param))
                    self.optimizer.state[param] = {
                        "step": torch.tensor(shared["adam_steps"][name], dtype=torch.float32), **moments}
        # The schedule resumes where it stopped, and so does the optimizer's learning rate.
        self.scheduler.load_state_dict(shared["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly distributed) tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class OneRank(FSDP2Sharding):
    """A single fp32 learner rank: the model itself, trained as plain PyTorch trains it.

    One rank has nothing to shard and fp32 nothing to cast: FSDP2 would only copy every
    parameter into its all-gather buffer and out again on each forward and backward, and
    run the optimizer over DTensors. Checkpoints are FSDP2's of one rank (its shard is the
    whole tensor), so a group of any size loads them and this rank loads theirs. A bf16
    rank stays with FSDP2, whose mixed precision casts the fp32 masters for the compute.
    """

    whole_parameters = True

    def __init__(self, model: torch.nn.Module, cfg: Config, world_size: int, device: torch.device):
        make_masters(model)
        model.to(device)
        self.model = self.module = model
        self.world_size = 1
        self.cpu_group = None
        self.optimizer, self.scheduler = make_optimizer(model, cfg)
        self.grad_clip = cfg.learner.grad_clip
        self.skip_above = cfg.learner.skip_grad_norm_above


DEEPSPEED_CPU_OPS = Path(sys.prefix) / "torch_extensions"
"""Where DeepSpeed's CPU op is built and found (torch's `TORCH_EXTENSIONS_DIR`): inside the
environment. On the CPU accelerator, `deepspeed.initialize` builds its shared-memory collective
(`deepspeed_shm_comm`) on first use, about 25 s of compiling here; torch keys that build by its
sources' absolute paths, so with its default folder (`~/.cache/torch_extensions`) two checkouts
rebuild it for each other in turn. `make test` builds it with the environment
(`build_deepspeed_cpu_ops`), so no test waits for a compiler."""


def build_deepspeed_cpu_ops() -> None:
    """Build DeepSpeed's CPU shared-memory collective into `DEEPSPEED_CPU_OPS` now, quietly (a
    compiler error still ends in an exception). A run with `learner.strategy: deepspeed` on
    CPU would otherwise build it when its learners start."""
    import contextlib
    import io

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEEPSPEED_CPU_OPS))
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator import get_accelerator

    with contextlib.redirect_stdout(io.StringIO()):
        get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)


class DeepSpeedSharding:
    """DeepSpeed ZeRO stage 2: gradients and optimizer state sharded, parameters whole on every rank.

    The worker has already joined the process group, so DeepSpeed reuses it. Our own
    scheduler drives the learning rate (the same schedule as FSDP2), and each mini-batch's
    micro-batches accumulate with `scale_wrt_gas=False`: the loss is already normalised.
    A step whose gradient norm is not finite is skipped by DeepSpeed itself. With a bf16
    compute dtype, DeepSpeed's bf16 mode keeps fp32 master weights in the optimizer's
    partitions and bf16 copies in the module; gradients are reduced and accumulated in fp32,
    as FSDP2's are (DeepSpeed would use the model's bf16 for both unless told:
    `communication_data_type`, `data_types.grad_accum_dtype`).
    """

    whole_parameters = True  # ZeRO-2 partitions gradients and optimizer state only

    def __init__(self, model: torch.nn.Module, cfg: Config, world_size: int, device: torch.device):
        # Ray gives each learner actor its own device, so the local rank is always 0; the
        # accelerator follows the configured device, not whatever DeepSpeed detects.
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ["DS_ACCELERATOR"] = "cuda" if device.type == "cuda" else "cpu"
        if device.type == "cpu":
            os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEEPSPEED_CPU_OPS))
        import deepspeed

        make_masters(model)  # (DeepSpeed's bf16 mode copies its fp32 partitions from the module, then casts it)
        optimizer, self.scheduler = make_optimizer(model, cfg)
        self.bf16 = cfg.model.dtype == "bfloat16"
        config = {
            "train_micro_batch_size_per_gpu": 1,  # unused: the worker forms its own micro-batches
            "gradient_accumulation_steps": 1,  # the worker marks accumulation boundaries itself
            "gradient_clipping": cfg.learner.grad_clip,
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,  # torch AdamW
            "bf16": {"enabled": self.bf16},
            "communication_data_type": "fp32",
            "data_types": {"grad_accum_dtype": "fp32"},
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
        return grad_norm, math.isfinite(grad_norm)

    def full_tensors(self, dtype: torch.dtype | None = None, trained_only: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        from deepspeed.utils import safe_get_full_fp32_param

        params = [(name, param) for name, param in self.module.named_parameters()
                  if param.requires_grad or not trained_only]
        if self.bf16 and dtype == torch.bfloat16:
            # ZeRO-2 keeps the bf16 weights whole on every rank, each the fp32 master as the
            # optimizer's step rounded it (a copy into bf16, which rounds as `.to` does): a
            # sync sends them as they are, without gathering the fp32 masters.
            for name, param in params:
                yield name, param.detach()
            return
        for name, param in params:
            # The fp32 master (gathered from the optimizer's partitions), not the bf16 copy; a
            # frozen base parameter has none (LoRA): it is what it holds.
            master = (safe_get_full_fp32_param(param) if self.bf16 and param.requires_grad else param).detach()
            yield name, master if dtype is None else master.to(dtype)

    def full_state(self, dtype: torch.dtype, rank: int, trained_only: bool = False) -> dict[str, torch.Tensor] | None:
        # ZeRO-2 keeps its state on the GPU all along (nothing is offloaded): every rank takes
        # part in each gather there, and rank 0 alone copies the tensors to host memory.
        state = {}
        for name, tensor in self.full_tensors(trained_only=trained_only):
            if rank == 0:
                state[name] = tensor.to("cpu", dtype, copy=True)
        return state if rank == 0 else None


SHARDINGS: dict[str, type[Sharding]] = {"fsdp2": FSDP2Sharding, "deepspeed": DeepSpeedSharding}
"""The code of each `learner.strategy` (what each can do: `rayrep.config.strategies`)."""


def make_sharding(model: torch.nn.Module, cfg: Config, world_size: int, device: torch.device) -> Sharding:
    """`learner.strategy`'s sharding of `model`; one fp32 rank of a strategy that shards the
    parameters trains the model itself, as plain PyTorch does (nothing to shard)."""
    if cfg.learner.sharding.shards_parameters and not fsdp2_shards(cfg, world_size):
        return OneRank(model, cfg, world_size, device)
    return SHARDINGS[cfg.learner.strategy](model, cfg, world_size, device)
