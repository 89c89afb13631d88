"""Residency: where each part of one process's GPU memory is, and what its allocator holds.

Colocated, a learner rank and an engine worker take turns on one GPU, and every defect the
GPU paths have had was one of sequence: a part left on the wrong device by a hand-over, two
large things held at once, a buffer kept past its phase. So each object that moves GPU
memory (`LearnerWorker`, `GeneratorWorker`, the handle transport) keeps its parts here as
state: where each one is (`DEVICE`, `HOST`, `DROPPED`, `ABSENT`); moves that are idempotent
(asking for what is already there moves nothing, and says so); and `require`, which every
operation calls with what it needs before it runs, failing with one line that names the
part and where it is instead of running on the wrong device.

Where the run models its GPUs' memory (GPU runs, and CPU runs with `placement.emulate_gpus`),
each part also has a size in bytes, and the object keeps a model of what the process holds on
its GPU: the parts on the device, the parts an operation under way allocated for itself
(`working`), and what torch's caching allocator keeps reserved after they are freed (the
most it held since the last `release_cache`, which is torch's `empty_cache`). Parts that vLLM
maps and unmaps itself (an engine's weights and KV cache: `engine_mapped`) go back to the device at
once. `report` gives the runtime's ledger (`rayrep.cluster.memory.DeviceLedger`) the peak since
the last report, with what made it, and on GPUs what was measured beside it: the whole
device's use (`measure`, `torch.cuda.mem_get_info`) sampled by the process itself just before
it releases memory (its allocator's cache, an engine's sleep) and at the report, so that
the figure holds the phase's peak, which the report alone, after the release, would miss;
and, in a learner, torch's reserved bytes (in an engine they say nothing: vLLM's allocator
unmaps pages that torch still counts as reserved).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

DEVICE, HOST, DROPPED, ABSENT = "device", "host", "dropped", "absent"
PLACES = {DEVICE: "on the device", HOST: "in host memory", DROPPED: "dropped (vLLM sleep level 2)",
          ABSENT: "not there (never made, or freed)"}
ALLOCATOR_CACHE = "allocator cache"
"""What torch's caching allocator keeps reserved beyond the parts allocated now."""


class ResidencyError(RuntimeError):
    """An operation found a part of GPU memory somewhere other than where it needs it."""


@dataclass
class Holding:
    """One process's GPU memory as its `Residency` reports it at a transition of the run."""

    owner: str
    """Who holds it: "learner rank 0", "generator 1"."""
    role: str
    """The memory plan's holder: "learner" or "engine"."""
    where: dict[str, str]
    """Each part's place now."""
    reserved: int
    """Bytes held on the device now (allocated parts and the allocator's cache)."""
    peak: int
    """The most held on the device since the last report."""
    at_peak: dict[str, int] = field(default_factory=dict)
    """What made the peak: the parts on the device then, and the allocator's cache beyond them."""
    measured_reserved: int | None = None
    """In a learner on a GPU, what torch reports: `memory_reserved` now (None elsewhere)."""
    measured_peak: int | None = None
    """In a learner on a GPU, torch's `max_memory_reserved` since the last report."""
    device_used: int | None = None
    """On a GPU, the most every process held on this process's device at this process's
    samples since the last report (before each release, and now)."""


class Residency:
    def __init__(self, owner: str, role: str, where: Mapping[str, str], sizes: Mapping[str, int] | None = None,
                 device=None, engine_mapped: Iterable[str] = (), measure: Callable[[], int] | None = None):
        """`where`: each part's place at the start. `sizes`: bytes per part (the memory plan's
        figures; a move or an operation may give a part's real size instead), None where the
        run does not model its GPUs. `device`: the torch device the process computes on (a
        CUDA one is measured too). `engine_mapped`: parts whose memory leaves the device at once
        (vLLM's pools). `measure`: the device's use now, in bytes (by default on a CUDA device
        `device_use`; None: not measured)."""
        self.owner, self.role, self.device = owner, role, device
        self.on_gpu = device is not None and getattr(device, "type", None) == "cuda"
        """Whether the process computes on a CUDA device, whose figures are measured too."""
        self.measure = measure if measure is not None else (lambda: device_use(device)) if self.on_gpu else None
        self.device_peak: int | None = None
        """The most `measure` gave since the last report."""
        self.where = dict(where)
        self.sizes = dict(sizes or {})
        self.engine_mapped = frozenset(engine_mapped)
        self.working: dict[str, int] = {}
        """Parts the operation under way allocated for itself, with their bytes."""
        self.cached = 0
        """The most the caching allocator held since its cache was last released."""
        self.peak, self.at_peak = 0, {}
        self._count()

    # ------------------------------------------------------------------ places

    def at(self, part: str) -> str:
        return self.where.get(part, ABSENT)

    def on_device(self, part: str) -> bool:
        return self.at(part) == DEVICE

    def move(self, part: str, to: str, nbytes: int | None = None) -> bool:
        """Put `part` at `to`; whether it moved (False: it was there already, nothing to do).
        `nbytes`: the part's real size, where the caller knows it."""
        if nbytes is not None:
            self.sizes[part] = int(nbytes)
        if self.at(part) == to:
            return False
        self.where[part] = to
        self._count()
        return True

    def require(self, operation: str, *parts: str, place: str = DEVICE) -> None:
        """Refuse `operation` unless every one of `parts` is at `place`: one line naming the
        first part that is not, and where it is."""
        for part in parts:
            if self.at(part) != place:
                raise ResidencyError(f"{self.owner}: {operation} needs its {part} {PLACES[place]}, "
                                     f"and it is {PLACES[self.at(part)]}")

    # ------------------------------------------------------------------ bytes

    @contextmanager
    def working_on(self, parts: Mapping[str, int] | Iterable[str]) -> Iterator[None]:
        """For the block, the operation's own parts (bytes given, or the plan's sizes) are
        allocated on the device; after it they are freed, and the allocator keeps them."""
        sizes = dict(parts) if isinstance(parts, Mapping) else {p: self.sizes.get(p, 0) for p in parts}
        before = dict(self.working)
        self.working.update(sizes)
        self._count()
        try:
            yield
        finally:
            self.working = before
            self._count()

    def sample_device(self) -> None:
        """Measure the device's use now (where it is measured): called before memory is
        released, so that the phase's peak is among the samples its report gives."""
        if self.measure is not None:
            self.device_peak = max(self.device_peak or 0, self.measure())

    def release_cache(self) -> None:
        """The allocator's cache back to the device (torch's `empty_cache` on a GPU), the
        device's use sampled just before."""
        self.sample_device()
        if self.on_gpu:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.cached = self._allocated(engine_mapped=False)
        self._count()

    def _parts_on_device(self) -> dict[str, int]:
        held = {part: self.sizes.get(part, 0) for part, place in self.where.items() if place == DEVICE}
        for part, nbytes in self.working.items():
            held[part] = held.get(part, 0) + nbytes
        return held

    def _allocated(self, engine_mapped: bool) -> int:
        return sum(n for part, n in self._parts_on_device().items() if (part in self.engine_mapped) == engine_mapped)

    @property
    def reserved(self) -> int:
        return self._allocated(engine_mapped=True) + self.cached

    def _count(self) -> None:
        self.cached = max(self.cached, self._allocated(engine_mapped=False))
        if self.reserved > self.peak:
            held = self._parts_on_device()
            beyond = self.cached - self._allocated(engine_mapped=False)
            self.peak, self.at_peak = self.reserved, {**held, **({ALLOCATOR_CACHE: beyond} if beyond else {})}

    def report(self) -> Holding:
        """What this process holds now and at its peak since the last report (then the peak
        starts again from now); on a GPU, torch's own figures beside the model's."""
        holding = Holding(self.owner, self.role, dict(self.where), self.reserved, self.peak, dict(self.at_peak))
        self.sample_device()
        holding.device_used, self.device_peak = self.device_peak, None
        if self.on_gpu and not self.engine_mapped:
            import torch

            holding.measured_reserved = torch.cuda.memory_reserved(self.device)
            holding.measured_peak = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak, self.at_peak = 0, {}
        self._count()
        return holding


def device_use(device) -> int:
    """What every process holds on the CUDA `device` now, in bytes (the driver's own figure)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return total - free
