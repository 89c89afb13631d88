"""Progress lines with an ETA for long loops (training steps, pool collection, evaluation).

Standard library only, so that any role can import it. One plain line per update, never a
carriage return: the output ends up in log files and in `ray job submit` logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """Reports `done` of `total` units of work, one line per `update`, with elapsed time and an ETA.

        progress = Progress(60, "train", unit="step")
        progress.update(0, **{"test pass@1": 0.262})  # nothing done yet: restarts the rate clock
        progress.update(12, reward="+0.120", acc=0.45)
        # train  step 12/60 [##........] 20% | 1m32s elapsed, ETA 6m10s | reward +0.120 acc 0.450 | 4.2 s/step

    The ETA is the remaining units times the mean time per unit since the rate clock
    started: at construction, and again at every update that reports no more units done
    than when it last started. A loop that opens with work that is not one of its units
    (training's step-0 evaluation) reports it as `update(0, ...)` so that it does not
    count in the rate; the elapsed time still counts it. After the first unit, the ETA is
    the remaining units times that unit's time; before it (or when no time has passed on
    the clock) it shows `--`.

    Args:
        total: the units the loop will do (steps, questions, prompts).
        label: what the loop is, first on each line ("train", "collect", "eval").
        unit: the name of one unit, in the counter and the rate ("step", "question").
        log: receives each line (`print` by default; a run's `log` function).
        clock: seconds as a float, monotonic; tests pass a fake one.
        done: units already done before this process (a resumed run's steps): they count
            in the bar, not in the rate.
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        unit: str = "step",
        log: Callable[[str], object] = print,
        clock: Callable[[], float] = time.monotonic,
        done: int = 0,
    ):
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total!r}")
        self.total, self.label, self.unit, self.log, self.clock = total, label, unit, log, clock
        self.started = clock()
        self.rate_since, self.rate_done = self.started, done

    def update(self, done: int, /, **latest: object) -> str:
        """Logs and returns one line: progress, elapsed time, ETA, the `latest` values, the rate.

        `latest` maps a label to a value shown after it, in the order given: a str as it is
        (pre-formatted, such as a signed reward), an int as it is, a float to three decimals
        (one above 10, none above 100); None values are left out. Labels that are not Python
        names go in with `**{"test pass@1": 0.3}`.
        """
        now = self.clock()
        if done <= self.rate_done:  # no unit finished since the rate clock started: restart it
            self.rate_since, self.rate_done = now, done
        units, seconds = done - self.rate_done, now - self.rate_since
        per_unit = seconds / units if units > 0 and seconds > 0 else None

        share = min(1.0, done / self.total) if self.total else 1.0
        filled = int(share * BAR_WIDTH)
        if done >= self.total:
            eta = "0s"
        elif per_unit is None:
            eta = "--"
        else:
            eta = format_duration(per_unit * (self.total - done))
        parts = [
            f"{self.label}  {self.unit} {done}/{self.total} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
            f"{int(share * 100)}%",
            f"{format_duration(now - self.started)} elapsed, ETA {eta}",
        ]
        values = " ".join(f"{name} {format_value(value)}" for name, value in latest.items() if value is not None)
        if values:
            parts.append(values)
        if per_unit is not None:
            parts.append(format_rate(per_unit, self.unit))
        line = " | ".join(parts)
        self.log(line)
        return line


BAR_WIDTH = 10


def format_duration(seconds: float) -> str:
    """Whole seconds as `45s`, `6m10s` or `2h03m`."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_value(value: object) -> str:
    if isinstance(value, float):
        size = abs(value)
        return f"{value:.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.3f}"
    return str(value)


def format_rate(seconds_per_unit: float, unit: str) -> str:
    """`4.2 s/step` for slow units, `12.5 question/s` for fast ones."""
    if seconds_per_unit >= 100:
        return f"{seconds_per_unit:.0f} s/{unit}"
    if seconds_per_unit >= 0.1:
        return f"{seconds_per_unit:.1f} s/{unit}"
    return f"{1 / seconds_per_unit:.1f} {unit}/s"
