"""A process's long-lived objects, out of the cyclic garbage collector's way.

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
import gc
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
