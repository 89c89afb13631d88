"""The run's log: one JSON record per step in `metrics.jsonl`, mirrored to the sinks the
config asks for (wandb, TensorBoard, Ray's metrics: `rayrep.run.sinks`), read back for plots
and studies, cut back to a checkpoint's step on resume, and the headline fields of the
progress line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rayrep.run import sinks
from rayrep.run.layout import RunFolder


class MetricsLog:
    """One JSON object per line in `<run_dir>/metrics.jsonl`, and the same records to each of
    `logging`'s sinks: wandb (`logging.wandb`), TensorBoard (`logging.tensorboard`), Ray's
    metrics (`logging.ray_metrics`). `metrics.jsonl` is the record: a sink that fails to start
    or to take a record (an unwritable folder, a full disk, a lost connection) is dropped with
    one line through `log`, and the run goes on without it, losing nothing from the file.

    `resumed_at`: the step a resumed run goes on from (the records after it were dropped
    from the file; TensorBoard hides them too).
    """

    def __init__(self, run_dir: Path, config_dict: dict, logging=None, resumed_at: int | None = None, log=print):
        folder = RunFolder(Path(run_dir))
        self.path = folder.metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", buffering=1)
        self.log_line, self.sinks = log, []
        wanted = [] if logging is None else [  # (asked, the sink, its arguments)
            (logging.wandb, sinks.WandbSink, (folder.path, config_dict, logging.wandb_project, logging.wandb_mode)),
            (logging.tensorboard, sinks.TensorBoardSink, (folder.tensorboard, config_dict, resumed_at)),
            (logging.ray_metrics, sinks.RayMetricsSink, (folder.path,))]
        for asked, sink, arguments in wanted:
            if asked:
                try:
                    self.sinks.append(sink(*arguments))
                except Exception as err:  # a logger is never worth the run
                    self._dropped(sink.name, err)

    def log(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        clean.setdefault("time", round(time.time(), 3))
        self.file.write(json.dumps(clean) + "\n")
        self._each(lambda sink: sink.write(clean))

    def close(self) -> None:
        self.file.close()
        self._each(lambda sink: sink.close())
        self.sinks = []

    def _each(self, call) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as err:
                self.sinks.remove(sink)
                self._dropped(sink.name, err)

    def _dropped(self, name: str, err: Exception) -> None:
        self.log_line(f"warning: {name} stopped ({type(err).__name__}: {err}); the run goes on, "
                      f"and {self.path} holds every record")


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
