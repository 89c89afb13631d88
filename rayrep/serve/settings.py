"""The settings a checkpoint is served with, and what is refused before a server starts.

A checkpoint is served as the run that wrote it ran it: `--follow RUN`, or a checkpoint in
`RUN/checkpoints/`, takes RUN's own config.json (its device, dtype, engine settings) as the
base. Any other folder takes the default preset's settings with the checkpoint's own dtype
(its config.json) and the device this job finds: a GPU where the machine, or the cluster it
runs on, has one. A `--preset` named on the command line is the base instead, and the
command line's fields go on top of whichever base.

Before anything starts: the engine's memory for one sequence of the served context (a GPU's
memory plan, or on a CPU the KV cache `generator.cpu_kv_cache_gib` gives), and, once the job
has joined its cluster, GPUs for every replica (`serve.run` would otherwise wait forever for
a replica that cannot be placed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rayrep.cluster.memory import GIB, MemoryPlan, compute_bytes, memory_plan, model_shape
from rayrep.config import Config, InputError, load_preset
from rayrep.run.layout import RunFolder


def run_of(checkpoint: str | None, follow: str | None) -> RunFolder | None:
    """The run whose checkpoint is served (`--follow RUN`, or `RUN/checkpoints/<name>`), if it
    has its config.json."""
    if follow:
        run = RunFolder(Path(follow))
        if any(run.path.glob("*.safetensors")):
            return None  # a checkpoint, not a run: the job says so
    elif checkpoint and Path(checkpoint).resolve().parent.name == "checkpoints":
        run = RunFolder.of_checkpoint(checkpoint)
    else:
        return None
    return run if run.config.is_file() else None


def checkpoint_dtype(checkpoint: str) -> str | None:
    """The compute dtype a checkpoint's config.json names (`torch_dtype` / `dtype`), if it is
    one a run computes in."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")
    return dtype if dtype in ("float32", "bfloat16") else None


def gpus_here() -> float:
    """GPUs of the cluster this job runs on (under `ray job submit`: RAY_ADDRESS's), else of this machine."""
    if os.environ.get("RAY_ADDRESS"):
        import logging

        import ray

        ray.init(ignore_reinit_error=True, logging_level=logging.ERROR)
        return ray.cluster_resources().get("GPU", 0.0)
    import torch

    return float(torch.cuda.device_count())


def serving_base(checkpoint: str | None, follow: str | None, preset_named: bool) -> dict | None:
    """The base config of a server (see the module's docstring); None: the preset's."""
    if preset_named:
        return None
    run = run_of(checkpoint, follow)
    if run is not None:
        data = json.loads(run.config.read_text(encoding="utf-8"))
        data.pop("logging", None)  # the server's own output goes where this job says
        return data
    if not checkpoint:
        return None  # the embedded tiny policy: its preset
    data = load_preset().to_dict()
    data["model"]["dtype"] = checkpoint_dtype(checkpoint) or data["model"]["dtype"]
    data["placement"]["device"] = "gpu" if gpus_here() else "cpu"
    return data


def check_serving_memory(cfg: Config, checkpoint: str, context: int) -> MemoryPlan | None:
    """Refuse a server whose engine cannot hold one sequence of `context` tokens: on GPUs
    the memory plan's (returned, for --dry-run to print); on a CPU, the KV cache that
    `generator.cpu_kv_cache_gib` gives."""
    if cfg.placement.device == "gpu":
        plan = memory_plan(cfg, trains=False, local_only=False, sequence=context, model_path=checkpoint)
        if plan is not None and plan.problems():
            raise InputError("the server's memory plan does not fit: " + "; ".join(plan.problems()) + "\n"
                             + plan.describe())
        return plan
    shape = model_shape(cfg, local_only=True, path=checkpoint)
    if shape is None:
        raise InputError(f"{checkpoint}: no config.json to size the server's KV cache from")
    needed = context * shape.kv_bytes_per_token(compute_bytes(cfg))
    have = int(cfg.generator.cpu_kv_cache_gib * GIB)
    if needed > have:
        raise InputError(f"a {context:,}-token context of {checkpoint} needs {needed / GIB:.2f} GiB of KV cache "
                         f"({cfg.model.dtype}), more than generator.cpu_kv_cache_gib={cfg.generator.cpu_kv_cache_gib}: "
                         f"raise it, or serve a shorter context (serve.max_model_len)")
    return None


def check_replicas_fit(cfg: Config, gpus: float, grows: bool = False) -> None:
    """Refuse GPU replicas the cluster cannot place (`gpus`: what it has or, autoscaling, can
    have): each replica takes `generator.tensor_parallel_size` whole GPUs."""
    if cfg.placement.device != "gpu" or grows and not gpus:
        return
    needed = cfg.serve.min_replicas * cfg.generator.tensor_parallel_size
    if needed > gpus + 1e-9:
        raise InputError(f"serve.min_replicas={cfg.serve.min_replicas} x generator.tensor_parallel_size="
                         f"{cfg.generator.tensor_parallel_size} needs {needed} GPU(s), and the cluster "
                         f"{'can reach' if grows else 'has'} {gpus:g}: each replica's engine takes whole GPUs of its own")
