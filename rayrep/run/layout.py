"""A run's folder, defined once: every module that reads or writes a run's files asks here.

    <out_dir>/<run_name>/
        config.json         the run's config (what --resume starts from)
        machine.json        the CPU and kernels of each start of the run (`rayrep.machine`)
        metrics.jsonl       one record per step (`rayrep.run.log`)
        evals.json          every evaluation, written when the run finishes
        checkpoints/        step-<N>/ and final -> step-<last> (`rayrep.run.checkpoints`)
        replay/             the replay buffer's latest snapshot (the replay methods)
        plots/              learning curves (`rayrep.plots`)
        libraries.log       what the actors' libraries printed
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from rayrep.config import Config
from rayrep.library_output import LIBRARY_LOG

STATE_FILE = "run_state.json"
"""Written last into a step checkpoint: the folder is complete once it is there."""
_STEP = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class RunFolder:
    path: Path

    @staticmethod
    def of(cfg: Config) -> "RunFolder":
        """The folder of the run `cfg` describes: `logging.run_name` under `logging.out_dir`, or
        the algorithm and the start time when it has no name."""
        name = cfg.logging.run_name or f"{cfg.algorithm.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        return RunFolder(Path(cfg.logging.out_dir) / name)

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def machine(self) -> Path:
        return self.path / "machine.json"

    def note_machine(self, step: int, path: dict) -> None:
        """Add the machine and kernels (`rayrep.machine.numeric_path`) of a start at `step`
        (0: a new run) to the run's `machine.json`, after those of its earlier starts."""
        starts = json.loads(self.machine.read_text()) if step and self.machine.is_file() else []
        self.machine.write_text(json.dumps(starts + [{"step": step, **path}], indent=1) + "\n")

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def evals(self) -> Path:
        return self.path / "evals.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def final(self) -> Path:
        return self.checkpoints / "final"

    def step_checkpoints(self) -> list[tuple[int, Path]]:
        """The complete step checkpoints (`step-<N>` folders with their run state), oldest first."""
        found = []
        if self.checkpoints.is_dir():
            for entry in self.checkpoints.iterdir():
                match = _STEP.match(entry.name)
                if match and entry.is_dir() and not entry.is_symlink() and (entry / STATE_FILE).is_file():
                    found.append((int(match.group(1)), entry))
        return sorted(found)

    def newest_checkpoint(self) -> Path | None:
        """The newest complete step checkpoint, or None before the first."""
        found = self.step_checkpoints()
        return found[-1][1] if found else None

    @property
    def replay(self) -> Path:
        return self.path / "replay"

    @property
    def plots(self) -> Path:
        return self.path / "plots"

    @property
    def libraries_log(self) -> Path:
        return self.path / LIBRARY_LOG

    def finished(self) -> bool:
        """The run ended: its final checkpoint and its evaluations are written."""
        return self.final.exists() and self.evals.is_file()

    @staticmethod
    def of_checkpoint(checkpoint: str | Path) -> "RunFolder":
        """The run that wrote `checkpoint` (`<run>/checkpoints/<name>`)."""
        return RunFolder(Path(checkpoint).resolve().parents[1])
