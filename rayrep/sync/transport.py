"""How a sync's buckets reach the engines: the two transports and the one rule that picks one.

- `broadcast`: learner rank 0 broadcasts every bucket over a group of its own (NCCL on GPUs,
  gloo on CPU) whose other members are the engines' workers (`collective.WeightGroup`). For
  disaggregated runs, where no two members share a device.
- `handles`: colocated, engine worker j shares learner rank j's bundle, and so its GPU. NCCL
  refuses two ranks of one communicator on one device ("Duplicate GPU detected",
  `ncclInvalidUsage`), and every learner rank holds the full tensors anyway (`full_tensor()`
  is an all-gather): rank j packs each bucket into a buffer of its own and hands worker j a
  handle to it, which the worker opens without a copy. On GPUs the handle is a CUDA IPC
  handle (torch's `reduce_tensor`, as OpenRLHF, SkyRL and verl hand weights to a colocated
  engine); on CPU a shared-memory file (`torch.from_file`), the same protocol, so that the
  CPU tests run the colocated path. Handles and acknowledgements travel through a `TCPStore`
  hosted by learner rank 0; a sender fills a buffer again only once the worker has copied
  what it held (two buffers: the next bucket is packed while the worker copies this one).
  The buffers last one sync (the GPU is the engines' between syncs), and a learner rank
  finds the engine worker on its own GPU by the GPU's UUID: with tensor parallelism vLLM's
  Ray executor numbers its workers' GPUs its own way, not in the bundles' order.

Each is a `Transport` (`TRANSPORTS`), both of its ends and how many learner ranks send; the
runtime's side of a sync is `rayrep.sync.weights.WeightSync`. Which one a run uses is chosen in
one place, `rayrep.cluster.placement.weight_transport`: it follows from where the roles are
placed, and the memory and placement plans (and so `--dry-run`), which sit below this
package, need it too.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from rayrep.cluster.memory import SEND_BUFFERS
from rayrep.cluster.residency import ABSENT, DEVICE, Residency
from rayrep.sync.collective import GROUP_TIMEOUT, WeightGroup, WeightManifest, open_group, pack_bucket, unpack_bucket

SLOTS = 2
"""Buffers a handle sender fills in turn: bucket b waits until the worker has copied bucket b - 2."""


# ---------------------------------------------------------------------------- tensor handles


def share(buffer: torch.Tensor) -> dict:
    """A handle another process on the same device opens with `open_shared`, as plain JSON
    values (nothing is unpickled on the way): the fields of torch's CUDA IPC handle for a
    GPU tensor (`reduce_tensor`), the path of the shared-memory file behind a CPU
    `shared_buffer`."""
    if not buffer.is_cuda:
        return {"kind": "file", "path": _shared_files[buffer.data_ptr()], "size": buffer.numel()}
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (_, size, stride, offset, _, dtype, _, storage_handle, storage_bytes, storage_offset, _,
     counter_handle, counter_offset, _, _) = args
    # No CUDA event travels: the sender synchronises its stream before it publishes a bucket,
    # so the worker has nothing to wait on, and opens (and leaks) no event handle per share.
    return {"kind": "cuda", "size": list(size), "stride": list(stride), "offset": offset,
            "dtype": str(dtype).removeprefix("torch."), "storage_handle": storage_handle.hex(),
            "storage_bytes": storage_bytes, "storage_offset": storage_offset, "counter_handle": counter_handle.hex(),
            "counter_offset": counter_offset}


def open_shared(handle: dict, device: torch.device) -> torch.Tensor:
    """The tensor behind `handle` (from `share`), mapped into this process, no copy."""
    if handle["kind"] == "file":
        return torch.from_file(handle["path"], shared=True, size=handle["size"], dtype=torch.uint8)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    # The sender's device index means the sender's visible devices; this process names the
    # same GPU by its own (Ray gives both the GPU of their bundle), as OpenRLHF does.
    index = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(
        torch.Tensor, tuple(handle["size"]), tuple(handle["stride"]), handle["offset"], torch.storage.TypedStorage,
        getattr(torch, handle["dtype"]), index, bytes.fromhex(handle["storage_handle"]), handle["storage_bytes"],
        handle["storage_offset"], False, bytes.fromhex(handle["counter_handle"]), handle["counter_offset"], None,
        False)


_shared_files: dict[int, str] = {}
"""Data pointer of each CPU shared buffer of this process -> its file."""


def shared_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer another process can map: plain device memory on GPUs (CUDA IPC shares
    it), a file in shared memory on CPU, removed when the buffer goes."""
    if device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = folder / f"rayrep-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    _shared_files[buffer.data_ptr()] = str(path)
    weakref.finalize(buffer, _remove_shared_file, buffer.data_ptr(), str(path))
    return buffer


def _remove_shared_file(pointer: int, path: str) -> None:
    _shared_files.pop(pointer, None)
    Path(path).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- the handle channel


class PeerDied(RuntimeError):
    """The engine worker a sender hands buckets to is gone."""


class HandleChannel:
    """One learner rank and the engine worker beside it: `send` on the learner's side,
    `receive` on the worker's. Keys are numbered by sync, so both sides count their syncs."""

    def __init__(self, store: dist.TCPStore, worker: int, device: torch.device, peer_pid: int | None = None,
                 timeout: timedelta = GROUP_TIMEOUT):
        self.store, self.worker, self.device, self.peer_pid, self.timeout = store, worker, device, peer_pid, timeout
        self.syncs = 0

    def _key(self, kind: str, bucket: int) -> str:
        return f"sync{self.syncs}/worker{self.worker}/{kind}{bucket}"

    def send(self, manifest: WeightManifest, tensors: Iterator[torch.Tensor],
             residency: Residency | None = None) -> None:
        """Pack every bucket of `tensors` (manifest order, full shapes) and hand it over. The
        two buffers are made for this sync and freed after it (`residency`, the sender's,
        holds them meanwhile): between syncs the GPU is the engine's."""
        self.syncs += 1
        largest = manifest.largest_bucket_bytes
        slots = [shared_buffer(largest, self.device) for _ in range(SLOTS)]
        if residency is not None:
            residency.move(SEND_BUFFERS, DEVICE, SLOTS * largest)
        try:
            handles = [share(slot) for slot in slots]
            for index, bucket in enumerate(manifest.buckets):
                if index >= SLOTS:
                    self._wait(self._key("copied", index - SLOTS))
                slot = index % SLOTS
                pack_bucket(manifest, bucket, tensors, slots[slot])
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # packed before the worker reads
                self.store.set(self._key("bucket", index), json.dumps([slot, handles[slot]]))
            for index in range(max(0, len(manifest.buckets) - SLOTS), len(manifest.buckets)):
                self._wait(self._key("copied", index))
            for index in range(len(manifest.buckets)):
                self.store.delete_key(self._key("bucket", index))
                self.store.delete_key(self._key("copied", index))
        finally:
            del slots
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()  # the shares the worker let go of: freed, not kept by torch's IPC books
            if residency is not None:
                residency.move(SEND_BUFFERS, ABSENT)

    def receive(self, manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
        """Every bucket's (name, tensor) views, in manifest order. Each bucket is copied out
        of the sender's buffer at once (the loader may hold views until a whole layer
        arrived), so the sender can fill that buffer again; the buffers' mappings are let go
        of when the sync ends."""
        self.syncs += 1
        opened: dict[int, torch.Tensor] = {}
        for index, bucket in enumerate(manifest.buckets):
            slot, handle = json.loads(self.store.get(self._key("bucket", index)))
            if slot not in opened:
                opened[slot] = open_shared(handle, self.device)
            flat = unpack_bucket(manifest, bucket, opened[slot]).clone()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # copied before the buffer is refilled
            self.store.set(self._key("copied", index), b"")
            if index >= len(manifest.buckets) - SLOTS:  # the sender may free this buffer now
                opened.pop(slot, None)
            yield from manifest.views(bucket, flat)

    def _wait(self, key: str) -> None:
        """Until the worker has set `key`; fails at once if its process is gone (it shares
        this node), and after the transport's timeout otherwise."""
        deadline, pause = time.monotonic() + self.timeout.total_seconds(), 1e-4
        while not self.store.check([key]):
            if self.peer_pid is not None and not _alive(self.peer_pid):
                raise PeerDied(f"weight sync: engine worker {self.worker} (pid {self.peer_pid}) died during the sync")
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight sync: engine worker {self.worker} did not take bucket {key} "
                                   f"within {self.timeout}")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def close(self) -> None:
        self.store = None


def _alive(pid: int) -> bool:
    """Whether process `pid` of this node runs (a killed one its parent has not reaped yet
    is a zombie: not running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether the process exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


# ---------------------------------------------------------------------------- joining


WeightChannel = WeightGroup | HandleChannel


def device_identity(device: torch.device) -> str:
    """What names this process's GPU in every process (its UUID: each process numbers the
    GPUs it sees its own way); empty on CPU, where ranks and workers pair by index."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def paired_worker(rank: int, identity: str, workers: dict[int, str]) -> int:
    """The engine worker that learner rank `rank`, on the GPU named `identity`, hands its
    tensors to: the one on the same GPU (`workers`: each worker's GPU), or on CPU the one of
    the same index. A rank whose GPU holds no engine worker is a placement error, named."""
    if not identity:
        return rank
    for worker, theirs in sorted(workers.items()):
        if theirs == identity:
            return worker
    raise RuntimeError(f"weight sync: no engine worker shares learner rank {rank}'s GPU ({identity}); the engine "
                       f"workers' GPUs: {dict(sorted(workers.items()))}")


class Transport:
    """One way a sync's buckets reach the engines: both ends of it, and how many learner
    ranks send. `TRANSPORTS` holds the two; `rayrep.cluster.placement.weight_transport`
    names the run's."""

    name: str

    def senders(self, world_size: int) -> int:
        """How many learner ranks (the first ones) join a transport of `world_size` members."""
        raise NotImplementedError

    def join_as_learner(self, host: str, port: int, world_size: int, rank: int, backend: str,
                        device: torch.device, timeout: timedelta = GROUP_TIMEOUT) -> WeightChannel | None:
        """Learner rank `rank`'s end, or None when it sends nothing. Every member's join must
        be in flight together."""
        raise NotImplementedError

    def join_as_engine_worker(self, host: str, port: int, world_size: int, group_rank: int, backend: str,
                              device: torch.device, timeout: timedelta = GROUP_TIMEOUT) -> WeightChannel:
        """Engine worker `group_rank - 1`'s end (group rank 0 is learner rank 0's)."""
        raise NotImplementedError


class Broadcast(Transport):
    """Learner rank 0 broadcasts every bucket over a group whose other members are the engines' workers."""

    name = "broadcast"

    def senders(self, world_size: int) -> int:
        return 1

    def join_as_learner(self, host, port, world_size, rank, backend, device, timeout=GROUP_TIMEOUT):
        return open_group(host, port, world_size, 0, backend, device, timeout) if rank == 0 else None

    def join_as_engine_worker(self, host, port, world_size, group_rank, backend, device, timeout=GROUP_TIMEOUT):
        return open_group(host, port, world_size, group_rank, backend, device, timeout)


class Handles(Transport):
    """Each learner rank hands the engine worker on its own GPU (or, on CPU, of its own index)
    handles to buffers it packs, through a `TCPStore` hosted by learner rank 0."""

    name = "handles"

    def senders(self, world_size: int) -> int:
        return world_size - 1  # one per engine worker, the one beside it

    def join_as_learner(self, host, port, world_size, rank, backend, device, timeout=GROUP_TIMEOUT):
        store = _store(host, port, rank == 0, timeout)
        identity = device_identity(device)
        workers = {w: store.get(f"device{w}").decode() for w in range(world_size - 1)} if identity else {}
        worker = paired_worker(rank, identity, workers)
        peer_pid = int(store.get(f"pid{worker}"))  # the worker beside this rank has joined
        return HandleChannel(store, worker, device, peer_pid, timeout)

    def join_as_engine_worker(self, host, port, world_size, group_rank, backend, device, timeout=GROUP_TIMEOUT):
        worker = group_rank - 1
        store = _store(host, port, False, timeout)
        store.set(f"device{worker}", device_identity(device))
        store.set(f"pid{worker}", str(os.getpid()))
        return HandleChannel(store, worker, device, timeout=timeout)


TRANSPORTS: dict[str, Transport] = {transport.name: transport for transport in (Broadcast(), Handles())}
"""The transports by name (`rayrep.cluster.placement.weight_transport` gives the run's)."""


def _store(host: str, port: int, hosts: bool, timeout: timedelta) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=hosts, timeout=timeout, wait_for_workers=False)
