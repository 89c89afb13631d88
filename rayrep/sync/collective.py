"""Weight broadcast over a dedicated collective group, in flat buckets of bounded size.

The group is built from public torch APIs (`TCPStore`, `PrefixStore`, `ProcessGroupGloo` /
`ProcessGroupNCCL`), apart from any default group: vLLM creates its own default group
inside each generator (a world of size 1 on CPU), so `new_group` cannot span learner and
generators. Ranks here are group-local: the learner's rank 0 is rank 0, generator workers
follow.

Tensors travel in flat buckets (one dtype each, at most `bucket_bytes`, a bigger tensor
alone), not one call per tensor: the per-call latency of a collective dominates small
tensors. Both sides derive the bucket layout from the same `WeightManifest`; the
colocated transport (`rayrep.sync.transport`) packs the same buckets.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from rayrep.cluster.memory import SEND_BUFFERS
from rayrep.cluster.residency import ABSENT, DEVICE, Residency

GROUP_TIMEOUT = timedelta(minutes=10)
"""How long a member waits for the others (store, gloo and NCCL collectives alike), unless
the run says otherwise (`sync.timeout_s`)."""

NCCL_DEFAULTS = {"NCCL_CUMEM_ENABLE": "0"}
"""NCCL settings every process of a run shares unless the driver's environment sets them.
A learner and a vLLM process that disagree on `NCCL_CUMEM_ENABLE` (older vLLM set it to 0
at import, in its own processes only) broke weight sync in SkyRL; 0 is the value vLLM chose
(cuMem costs GPU memory with CUDA graphs and all-reduce, NVIDIA/nccl#1234)."""


def nccl_environment(environ=None) -> dict[str, str]:
    """The NCCL environment of a run: every `NCCL_*` variable of the driver's environment
    (`environ`, by default this process's), over `NCCL_DEFAULTS`. Every actor starts with it,
    so that all members of a group run NCCL alike."""
    return {**NCCL_DEFAULTS, **nccl_variables(environ)}


def nccl_variables(environ=None) -> dict[str, str]:
    """Every `NCCL_*` variable of `environ` (by default this process's environment), in order of name."""
    import os

    environ = os.environ if environ is None else environ
    return {key: value for key, value in sorted(environ.items()) if key.startswith("NCCL_")}


NCCL_PROCESS_LOCAL = frozenset({"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_NO_CACHE",
                                 "NCCL_LAUNCH_MODE"})
"""NCCL variables that may differ between the members of one communicator: logging, which
variables NCCL re-reads per communicator, and how this process launches its kernels (vLLM's
batch invariance sets GROUP for its whole process, its own communicators and shared ones alike).
Every other one shapes how a collective runs (its protocol, algorithm, channels, threads,
memory), NCCL does not reconcile them across ranks, and members that differ hang."""


def nccl_settings(environ=None) -> dict[str, str]:
    """The NCCL variables a communicator opened now, in this process, would run with, that
    all its members must share (`environ`: by default this process's environment)."""
    return {key: value for key, value in nccl_variables(environ).items() if key not in NCCL_PROCESS_LOCAL}


def agree_on_nccl(store: dist.Store, rank: int, world_size: int, settings: dict[str, str]) -> None:
    """Refuse to open an NCCL group whose members would run it with different settings (it
    would hang at its first collective): each member posts its `nccl_settings`, rank 0 reads
    every other's and the others rank 0's, and a difference fails on both sides, naming it."""
    import json

    store.set(f"nccl-settings/{rank}", json.dumps(settings))
    for peer in range(1, world_size) if rank == 0 else (0,):
        theirs = json.loads(store.get(f"nccl-settings/{peer}"))
        if theirs != settings:
            differ = ", ".join(f"{key}: {settings.get(key, 'unset')} here, {theirs.get(key, 'unset')} at rank {peer}"
                               for key in sorted(set(settings) | set(theirs)) if settings.get(key) != theirs.get(key))
            raise RuntimeError(
                f"weight sync: group rank {rank} and rank {peer} would open their NCCL group with different settings "
                f"({differ}); NCCL does not reconcile them and the group would hang. An engine with "
                "generator.batch_invariant pins these for its own process, and unpins them for shared groups only "
                "with NCCL >= 2.29.7 (NCCL_NO_CACHE): use that NCCL, or turn generator.batch_invariant off, or "
                "colocate the roles (their weights travel by CUDA IPC handles, not NCCL)")


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


TIED_EMBEDDING = "model.embed_tokens.weight"
"""The input embedding's name in the policies' checkpoints (the Llama/Qwen layout): the output
head's weights too when `tie_word_embeddings` is set."""


@dataclass(frozen=True)
class WeightManifest:
    """What a sync sends, in order, and how it is packed into buckets (index lists)."""

    tensors: tuple[TensorSpec, ...]
    buckets: tuple[tuple[int, ...], ...]
    tied_embedding: str | None = None
    """Name of the input embedding when the output head shares it (sent once, loaded twice)."""
    adapter: Any = None
    """The `peft.LoraConfig` of a LoRA run's adapter, whose tensors alone a sync sends (named
    as in PEFT's files), for the engines to take as a new adapter; None: the policy's weights."""

    @staticmethod
    def build(specs: Iterable[TensorSpec], bucket_bytes: int, tied_embedding: str | None = None,
              adapter: Any = None) -> "WeightManifest":
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
        return WeightManifest(specs, tuple(buckets), tied_embedding, adapter)

    @property
    def total_bytes(self) -> int:
        return sum(s.numel * s.dtype.itemsize for s in self.tensors)

    def bucket_bytes(self, bucket: tuple[int, ...]) -> int:
        return sum(self.tensors[i].numel * self.tensors[i].dtype.itemsize for i in bucket)

    @property
    def largest_bucket_bytes(self) -> int:
        return max((self.bucket_bytes(b) for b in self.buckets), default=0)

    def views(self, bucket: tuple[int, ...], flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of each of the bucket's tensors: views into its flat buffer."""
        offset = 0
        for index in bucket:
            spec = self.tensors[index]
            yield spec.name, flat[offset : offset + spec.numel].view(spec.shape)
            offset += spec.numel


class WeightGroup:
    """A process group of its own, with a broadcast that takes group-local ranks."""

    def __init__(self, store: dist.Store, group: dist.ProcessGroup, rank: int, world_size: int, device: torch.device):
        self.store, self.group, self.rank, self.world_size, self.device = store, group, rank, world_size, device

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self.start_broadcast(tensor, root).wait()

    def start_broadcast(self, tensor: torch.Tensor, root: int = 0) -> dist.Work:
        """The broadcast, started: `tensor` must stay untouched until its `wait()` returns.
        Broadcasts run in the order they were started, on every member alike."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        return self.group.broadcast([tensor], options)

    def send(self, manifest: WeightManifest, tensors: Iterator[torch.Tensor],
             residency: Residency | None = None) -> None:
        """Broadcast `tensors` (in manifest order, full shapes) from group rank 0, pipelined:
        the next bucket is gathered and packed while this one is on the wire, and bucket b
        is packed only once bucket b - 2 has left (`IN_FLIGHT`), so two buckets at most are
        in memory (`residency`, the sender's: its send buffers for the sync's length)."""
        pending: deque[tuple[dist.Work, torch.Tensor]] = deque()
        if residency is not None:
            residency.move(SEND_BUFFERS, DEVICE, IN_FLIGHT * manifest.largest_bucket_bytes)
        try:
            for bucket in manifest.buckets:
                if len(pending) == IN_FLIGHT:
                    _settle(*pending.popleft(), self.device)
                buffer = torch.empty(manifest.bucket_bytes(bucket), dtype=torch.uint8, device=self.device)
                flat = pack_bucket(manifest, bucket, tensors, buffer)
                pending.append((self.start_broadcast(flat, root=0), flat))
            while pending:
                _settle(*pending.popleft(), self.device)
        finally:
            if residency is not None:
                residency.move(SEND_BUFFERS, ABSENT)

    def receive(self, manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive every bucket and yield (name, tensor) views into it, in manifest order; the
        next bucket is already being received while the caller loads this one's tensors."""

        def start(bucket: tuple[int, ...]) -> tuple[torch.Tensor, dist.Work]:
            # A fresh buffer per bucket: the loader may hold views until a whole layer arrived.
            buffer = torch.empty(manifest.bucket_bytes(bucket), dtype=torch.uint8, device=self.device)
            flat = unpack_bucket(manifest, bucket, buffer)
            return flat, self.start_broadcast(flat, root=0)

        upcoming = start(manifest.buckets[0]) if manifest.buckets else None
        for index, bucket in enumerate(manifest.buckets):
            flat, work = upcoming
            work.wait()
            if index + 1 < len(manifest.buckets):
                upcoming = start(manifest.buckets[index + 1])
            yield from manifest.views(bucket, flat)

    def close(self) -> None:
        """Leave the group. A member may have died (the group is left to be rebuilt with its
        replacement): abort drops every connection without waiting on the dead peer, and
        dropping the references tears the backend and the store down."""
        if self.group is not None:
            self.group.abort()
        self.group = None
        self.store = None


IN_FLIGHT = 2
"""Broadcast buckets a sender has started and not yet seen leave."""


def _settle(work: dist.Work, flat: torch.Tensor, device: torch.device) -> None:
    """Until `flat` has left. On GPUs `Work.wait()` only makes the current stream wait for
    NCCL's, and the CPU would run ahead, allocating bucket after bucket: an event recorded
    after it, waited on by the CPU, bounds the buckets in flight."""
    work.wait()
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        event.synchronize()


def open_group(host: str, port: int, world_size: int, rank: int, backend: str, device: torch.device,
               timeout: timedelta = GROUP_TIMEOUT) -> WeightGroup:
    """Join the weight group; every member's call must be in flight at the same time.
    `timeout`: how long a member waits for the others (`sync.timeout_s`). An NCCL group opens
    only once its members agree on their NCCL settings (`agree_on_nccl`)."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("rayrep-weight-sync", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout=timeout)
    elif backend == "nccl":
        agree_on_nccl(prefixed, rank, world_size, nccl_settings())
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_options(timeout))
    else:
        raise ValueError(f"unknown weight-sync backend {backend!r}; expected 'gloo' or 'nccl'")
    handle = WeightGroup(store, group, rank, world_size, device)
    # A first collective proves every member is connected before any weights move.
    probe = torch.zeros(1, device=device)
    handle.broadcast(probe, root=0)
    return handle


def pack_bucket(manifest: WeightManifest, bucket: tuple[int, ...], tensors: Iterator[torch.Tensor],
                buffer: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors, the next ones of `tensors`, into `buffer` (bytes, at least
    the bucket's size); returns the bucket's flat view of the buffer in its dtype."""
    flat = unpack_bucket(manifest, bucket, buffer)
    offset = 0
    for index in bucket:
        spec, tensor = manifest.tensors[index], next(tensors)
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"weight sync: {spec.name} has shape {tuple(tensor.shape)}, manifest says {spec.shape}")
        flat[offset : offset + spec.numel].copy_(tensor.reshape(-1))
        offset += spec.numel
    return flat


def unpack_bucket(manifest: WeightManifest, bucket: tuple[int, ...], buffer: torch.Tensor) -> torch.Tensor:
    """The bucket's flat view of `buffer` (bytes) in the bucket's dtype."""
    return buffer[: manifest.bucket_bytes(bucket)].view(manifest.tensors[bucket[0]].dtype)
