"""The run's log: one JSON record per step in `metrics.jsonl` (mirrored to wandb when
asked), read back for plots and studies, cut back to a checkpoint's step on resume, and the
headline fields of the progress line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Literal

from rayrep.run.layout import RunFolder


class MetricsLog:
    """One JSON object per line in `<run_dir>/metrics.jsonl`, mirrored to wandb when asked.

    wandb's offline mode (the default) writes a run folder under `<run_dir>/wandb/` and
    never touches the network (`wandb sync <that folder>` uploads it later); online mode
    streams to the wandb server with the user's key.
    """

    def __init__(
        self,
        run_dir: Path,
        config_dict: dict,
        use_wandb: bool = False,
        project: str = "rayrep",
        wandb_mode: Literal["offline", "online"] = "offline",
    ):
        self.path = RunFolder(Path(run_dir)).metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", buffering=1)
        self.wandb = start_wandb(Path(run_dir), config_dict, project, wandb_mode) if use_wandb else None

    def log(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        clean.setdefault("time", round(time.time(), 3))
        self.file.write(json.dumps(clean) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=record.get("step"))

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def start_wandb(run_dir: Path, config_dict: dict, project: str, mode: Literal["offline", "online"]):
    """A wandb run whose files live in `run_dir/wandb/`.

    Offline, wandb neither logs in nor uploads; its process-wide usage telemetry follows the
    global settings rather than the run's, so those are set offline too (`wandb.setup`),
    else it would look up wandb's server when the process exits.
    """
    import wandb

    if mode == "offline":
        wandb.setup(settings=wandb.Settings(mode="offline"))
    return wandb.init(project=project, name=run_dir.name, config=config_dict, dir=str(run_dir), mode=mode)


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


STEP_FIELDS = (  # (metric, label on the progress line, format)
    ("reward_mean", "reward", "{:+.3f}"),
    ("accuracy", "acc", "{:.3f}"),
    ("response_length", "len", "{:.1f}"),
    ("fresh_entropy", "ent", "{:.3f}"),
    ("grad_norm", "gnorm", "{:.2f}"),
    ("test_pass@1", "test pass@1", "{:.3f}"),
    ("time_step", "took", "{:.1f}s"),
    ("time_eval", "eval", "{:.1f}s"),
)


def step_fields(record: dict) -> dict[str, str]:
    """A training step's headline metrics, formatted for `rayrep.progress.Progress.update`."""
    return {label: fmt.format(record[key]) for key, label, fmt in STEP_FIELDS if record.get(key) is not None}


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the records a stopped run logged after its checkpoint's step (the resumed run
    logs them again), atomically."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    staging = path.with_suffix(".jsonl.tmp")
    staging.write_text("".join(line + "\n" for line in kept))
    staging.replace(path)
