"""A process's heap: its long-lived objects out of the cyclic garbage collector's way, and
its freed memory kept for the next allocation of the same size.

Each process of a run imports and builds a few hundred thousand objects that live as long
as it does: vLLM, torch and transformers, the policy, the prompt sets. While they are made,
Python's collector keeps running full collections that walk the whole growing heap (twelve
in a generator's start, 1.9 s of it here). `long_lived()` keeps the collector off while a
block makes what the process keeps, then freezes the heap (`gc.freeze`): those objects leave
the collector's view until the process exits, and every later collection walks only what
came after them (the explicit ones vLLM runs while it builds an engine included). The
price: whatever garbage the block left is kept too, once per process. At exit the heap is
unfrozen, so that the interpreter's last collection finalizes those objects as it would
have (extension modules check at exit that their objects were freed, and say so loudly).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


atexit.register(gc.unfreeze)  # nothing frozen: nothing done


@contextmanager
def long_lived() -> Iterator[None]:
    """The block's imports and objects, made with the collector off, then frozen."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


KEPT_TOP_BYTES = 1 << 30
"""Freed memory a process keeps at the top of its heap before giving any back (glibc's
`M_TRIM_THRESHOLD`)."""
HEAP_BLOCK_BYTES = 32 << 20
"""Blocks below this size come from the heap, above it from `mmap` (glibc's
`M_MMAP_THRESHOLD`; its largest allowed value on 64-bit Linux)."""


def keep_freed_memory() -> bool:
    """Make freed memory serve the next allocations instead of going back to the system.

    A CPU learner's update allocates and frees tensors of a few MB by the hundred ([tokens,
    intermediate] activations and their gradients). glibc gives such a block back to the
    system when it is freed (`mmap`ped blocks, and the top of the heap past 128 KiB), so the
    next one faults in and zeroes fresh pages: about 34,000 page faults per update of the tiny
    preset, a few percent of it (measured in docs/performance.md). With blocks below 32 MiB
    taken from the heap and up to 1 GiB of its free top kept, an update faults almost never.
    The price is the process's resident memory staying near its peak, as with a caching
    allocator. True where the allocator took the settings (glibc: Linux); elsewhere nothing
    changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # another C library (musl): its own allocator
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's malloc.h
    return all(libc.mallopt(option, value) == 1 for option, value in
               ((m_mmap_threshold, HEAP_BLOCK_BYTES), (m_trim_threshold, KEPT_TOP_BYTES), (m_top_pad, 64 << 20)))
