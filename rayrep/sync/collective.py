"""Weight broadcast over a dedicated collective group, in flat buckets of bounded size.

The group is built from public torch APIs (`TCPStore`, `PrefixStore`, `ProcessGroupGloo` /
`ProcessGroupNCCL`), apart from any default group: vLLM creates its own default group
inside each generator (a world of size 1 on CPU), so `new_group` cannot span learner and
generators. Ranks here are group-local: the learner's rank 0 is rank 0, generator workers
follow.

Tensors travel in flat buckets (one dtype each, at most `bucket_bytes`, a bigger tensor
alone), not one call per tensor: the per-call latency of a collective dominates small
tensors. Both sides derive the bucket layout from the same `WeightManifest`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

GROUP_TIMEOUT = timedelta(minutes=10)
"""How long a member waits for the others (store, gloo and NCCL collectives alike)."""

NCCL_DEFAULTS = {"NCCL_CUMEM_ENABLE": "0"}
"""NCCL settings every process of a run shares unless the driver's environment sets them.
A learner and a vLLM process that disagree on `NCCL_CUMEM_ENABLE` (older vLLM set it to 0
at import, in its own processes only) broke weight sync in SkyRL; 0 is the value vLLM chose
(cuMem costs GPU memory with CUDA graphs and all-reduce, NVIDIA/nccl#1234)."""


def nccl_environment(environ=None) -> dict[str, str]:
    """The NCCL environment of a run: every `NCCL_*` variable of the driver's environment
    (`environ`, by default this process's), over `NCCL_DEFAULTS`. Every actor starts with it,
    so that all members of a group run NCCL alike."""
    import os

    environ = os.environ if environ is None else environ
    return {**NCCL_DEFAULTS, **{key: value for key, value in environ.items() if key.startswith("NCCL_")}}


def nccl_options(timeout: timedelta = GROUP_TIMEOUT):
    """`ProcessGroupNCCL.Options` with the group's timeout: without options NCCL's own
    10-minute watchdog applies, whatever the group's. As torch's own `new_group` builds them
    (`distributed_c10d._new_process_group_helper`): a normal-priority stream, `_timeout`."""
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return options


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class WeightManifest:
    """What a sync sends, in order, and how it is packed into buckets (index lists)."""

    tensors: tuple[TensorSpec, ...]
    buckets: tuple[tuple[int, ...], ...]
    tied_embedding: str | None = None
    """Name of the input embedding when the output head shares it (sent once, loaded twice)."""

    @staticmethod
    def build(specs: Iterable[TensorSpec], bucket_bytes: int, tied_embedding: str | None = None) -> "WeightManifest":
        specs = tuple(specs)
        buckets: list[tuple[int, ...]] = []
        current: list[int] = []
        current_bytes, current_dtype = 0, None
        for index, spec in enumerate(specs):
            size = spec.numel * spec.dtype.itemsize
            if current and (spec.dtype != current_dtype or current_bytes + size > bucket_bytes):
                buckets.append(tuple(current))
                current, current_bytes = [], 0
            current.append(index)
            current_bytes += size
            current_dtype = spec.dtype
        if current:
            buckets.append(tuple(current))
        return WeightManifest(specs, tuple(buckets), tied_embedding)

    @property
    def total_bytes(self) -> int:
        return sum(s.numel * s.dtype.itemsize for s in self.tensors)


class WeightGroup:
    """A process group of its own, with a broadcast that takes group-local ranks."""

    def __init__(self, store: dist.Store, group: dist.ProcessGroup, rank: int, world_size: int):
        self.store, self.group, self.rank, self.world_size = store, group, rank, world_size

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self.start_broadcast(tensor, root).wait()

    def start_broadcast(self, tensor: torch.Tensor, root: int = 0) -> dist.Work:
        """The broadcast, started: `tensor` must stay untouched until its `wait()` returns.
        Broadcasts run in the order they were started, on every member alike."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        return self.group.broadcast([tensor], options)

    def close(self) -> None:
        """Leave the group. A member may have died (the group is left to be rebuilt with its
        replacement): abort drops every connection without waiting on the dead peer, and
        dropping the references tears the backend and the store down."""
        if self.group is not None:
            self.group.abort()
        self.group = None
        self.store = None


def open_group(host: str, port: int, world_size: int, rank: int, backend: str, device: torch.device) -> WeightGroup:
    """Join the weight group; every member's call must be in flight at the same time."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=GROUP_TIMEOUT)
    prefixed = dist.PrefixStore("rayrep-weight-sync", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout=GROUP_TIMEOUT)
    elif backend == "nccl":
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_options())
    else:
        raise ValueError(f"unknown weight-sync backend {backend!r}; expected 'gloo' or 'nccl'")
    handle = WeightGroup(store, group, rank, world_size)
    # A first collective proves every member is connected before any weights move.
    probe = torch.zeros(1, device=device)
    handle.broadcast(probe, root=0)
    return handle


def send_buckets(group: WeightGroup, manifest: WeightManifest, tensors: Iterator[torch.Tensor], device: torch.device) -> None:
    """Broadcast `tensors` (in manifest order, full shapes) from group rank 0, pipelined:
    the next bucket is gathered and packed while this one is on the wire (two buckets in
    memory at most)."""
    in_flight: dist.Work | None = None
    for bucket in manifest.buckets:
        specs = [manifest.tensors[i] for i in bucket]
        flat = torch.empty(sum(s.numel for s in specs), dtype=specs[0].dtype, device=device)
        offset = 0
        for spec in specs:
            tensor = next(tensors)
            if tuple(tensor.shape) != spec.shape:
                raise ValueError(f"weight sync: {spec.name} has shape {tuple(tensor.shape)}, manifest says {spec.shape}")
            flat[offset : offset + spec.numel].copy_(tensor.reshape(-1))
            offset += spec.numel
        if in_flight is not None:
            in_flight.wait()
        in_flight = group.start_broadcast(flat, root=0)
    if in_flight is not None:
        in_flight.wait()


def receive_buckets(group: WeightGroup, manifest: WeightManifest, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive every bucket and yield (name, tensor) views into it, in manifest order; the
    next bucket is already being received while the caller loads this one's tensors."""

    def start(bucket: list[int]) -> tuple[list[TensorSpec], torch.Tensor, dist.Work]:
        specs = [manifest.tensors[i] for i in bucket]
        # A fresh buffer per bucket: the loader may hold views until a whole layer arrived.
        flat = torch.empty(sum(s.numel for s in specs), dtype=specs[0].dtype, device=device)
        return specs, flat, group.start_broadcast(flat, root=0)

    upcoming = start(manifest.buckets[0]) if manifest.buckets else None
    for index in range(len(manifest.buckets)):
        specs, flat, work = upcoming
        work.wait()
        if index + 1 < len(manifest.buckets):
            upcoming = start(manifest.buckets[index + 1])
        offset = 0
        for spec in specs:
            yield spec.name, flat[offset : offset + spec.numel].view(spec.shape)
            offset += spec.numel
