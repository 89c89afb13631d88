"""The record of one training step, in typed parts: the time each phase took (adding up
over a step's rounds), what happened to actors and answers (counts, adding up), and the
values the roles measured. `as_dict` is the line `metrics.jsonl` holds."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from rayrep.run.log import step_fields


@dataclass
class StepRecord:
    step: int
    times: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (`time_<phase>` in the log): plan, generate, verify, hand_over, build, update, sync, ..."""
    counts: Counter = field(default_factory=Counter)
    """Events, by name: `generator_replaced`, `verifier_timeout`, `sampling_rounds`, ..."""
    values: dict[str, float] = field(default_factory=dict)
    """Everything else measured: the learners', the algorithm's, the buffer's, the evaluation's."""
    notes: dict[str, str] = field(default_factory=dict)
    """The first message behind a count, by the count's name, for the step's log (the
    first of the step's `verifier_error`s, say)."""

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the block's wall time to the phase (a phase that runs in several rounds of a
        step, such as a dynamic-sampling refill, adds up)."""
        start = time.perf_counter()
        yield
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start

    def count(self, events: Mapping[str, int], prefix: str = "") -> None:
        for name, n in events.items():
            self.counts[f"{prefix}{name}"] += n

    def add(self, values: Mapping[str, float]) -> None:
        self.values.update(values)

    def note(self, messages: Mapping[str, str]) -> None:
        for kind, message in messages.items():
            self.notes.setdefault(kind, message)

    def as_dict(self) -> dict:
        return {"step": self.step, **self.values, **self.counts, **{f"time_{k}": v for k, v in self.times.items()}}

    def progress_fields(self) -> dict[str, str]:
        return step_fields(self.as_dict())
