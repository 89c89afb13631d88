"""Where a run's step records go besides `metrics.jsonl`, which holds every one of them:
wandb, TensorBoard event files, and Ray's metrics (each node's Prometheus endpoint, which
Ray's Grafana reads). A sink takes the records `MetricsLog` writes (`write`) and is closed at
the run's end (`close`); `MetricsLog` drops one that fails, with one line, and the run goes on."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Literal

from rayrep.run.phases import PHASES, phase_seconds


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers, but its step and wall time (the x axes a scalar logger has)."""
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}


class WandbSink:
    """A wandb run whose files live in `run_dir/wandb/`.

    Offline (the default), wandb neither logs in nor uploads (`wandb sync <that folder>`
    uploads it later); its process-wide usage telemetry follows the global settings rather
    than the run's, so those are set offline too (`wandb.setup`), else it would look up
    wandb's server when the process exits. Online, it streams with the user's key.
    """

    name = "wandb"

    def __init__(self, run_dir: Path, config_dict: dict, project: str, mode: Literal["offline", "online"]):
        import wandb

        if mode == "offline":
            wandb.setup(settings=wandb.Settings(mode="offline"))
        self.run = wandb.init(project=project, name=run_dir.name, config=config_dict, dir=str(run_dir), mode=mode)

    def write(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """TensorBoard event files in `folder`: every number of each record as a scalar at its
    step and wall time, in double precision (what `metrics.jsonl` holds, to the digit), and
    the run's config as text at step 0. A resumed run hides what the stopped one logged after
    its checkpoint (`purge_step`), as `metrics.jsonl` drops those records.

    The writer queues events for a thread of its own: a write that failed there (a full disk)
    is raised by the next call, and so drops the sink then."""

    name = "TensorBoard"

    def __init__(self, folder: Path, config_dict: dict, resumed_at: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # Every start marks a session (SessionLog.START); TensorBoard takes each start after
        # the first as a restart and hides what came before it from its step on.
        self.writer = SummaryWriter(str(folder), purge_step=0 if resumed_at is None else resumed_at + 1)
        if resumed_at is None:
            self.writer.add_text("config", "```json\n" + json.dumps(config_dict, indent=1) + "\n```", 0)

    def write(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"], walltime=record.get("time"), new_style=True,
                                   double_precision=True)
        self.writer.flush()  # each step visible now, not after the writer's 2 minutes

    def close(self) -> None:
        self.writer.close()


TRAIN_GAUGES = {  # exported as ray_rayrep_train_<name>{run=...}: (the record's key, description)
    "step": ("step", "the step last logged"),
    "step_seconds": ("time_step", "the last step's wall time, s"),
    "generated_tokens_per_second": ("tokens_per_second", "tokens the generators sampled per second of the last step's generation"),
    "reward": ("reward_mean", "mean reward of the last step's fresh answers"),
    "accuracy": ("accuracy", "share of the last step's fresh answers that were correct"),
    "test_pass_at_1": ("test_pass@1", "pass@1 of the last evaluation"),
    "replay_share": ("replay_share", "share of the last step's trained answers that were replayed"),
    "policy_lag": ("fresh_lag_mean", "policy versions between the weights that sampled the last step's fresh answers and those they trained"),
    "policy_version": ("policy_version", "the generators' policy version"),
    "buffer_answers": ("buffer_answers", "answers held by the replay buffer"),
    "sync_seconds": ("sync_seconds", "the last weight sync's wall time, s"),
}
"""The gauges a run exports, each the record's value at its last step that logged it."""
DERIVED_GAUGES = {
    "trained_tokens_per_second": "tokens the learners trained on (fresh and replayed) per second of the last step",
    "phase_share": "share of the last step's wall time spent in each phase (label phase)",
    "accuracy_by_source": "share of the last step's fresh answers of each data source that were correct (label data_source; runs on several sources)",
    "reward_by_source": "mean reward of the last step's fresh answers of each data source (label data_source; runs on several sources)",
}
LABELS = {"phase_share": "phase", "accuracy_by_source": "data_source", "reward_by_source": "data_source"}
"""The gauges with a label besides `run`, and its name."""
COUNTERS = {  # exported as ray_rayrep_train_<name>_total
    "steps": "training steps taken",
    "generated_tokens": "tokens the generators sampled",
    "trained_tokens": "tokens the learners trained on, fresh and replayed",
    "actor_replacements": "actors that died and were replaced (label role)",
}
REFRESH_S = 5.0
"""How often the last values are set again: Ray exports a gauge only if it was set since
its previous export (every 10 s), and its agent forgets one after 20 s; a step takes minutes
on GPUs."""


def run_label(run_dir: Path) -> str:
    """The `run` label: the run folder and the folder it lies in (`runs/grpo-20261206-0101`,
    `rlep-pipeline-20261206-0101/rlep`), so that two pipelines' `rlep` runs stay apart."""
    return f"{run_dir.parent.name}/{run_dir.name}"


class RayMetricsSink:
    """Each step's headline figures through `ray.util.metrics`, from this (the driver's)
    process: Ray's agent on the node serves them in Prometheus' format (`ray_` before each
    name) at the node's metrics export port, where Ray's Prometheus and Grafana set-up reads
    them (deploy/grafana-dashboard.json). Labelled `run` (`run_label`)."""

    name = "Ray metrics"

    def __init__(self, run_dir: Path):
        from ray.util.metrics import Counter, Gauge

        self.tags = {"run": run_label(run_dir)}
        described = {**{name: description for name, (_, description) in TRAIN_GAUGES.items()}, **DERIVED_GAUGES}
        self.gauges = {name: Gauge(f"rayrep_train_{name}", description,
                                   tag_keys=("run", LABELS[name]) if name in LABELS else ("run",))
                       for name, description in described.items()}
        self.counters = {name: Counter(f"rayrep_train_{name}", description,
                                       tag_keys=("run", "role") if name == "actor_replacements" else ("run",))
                         for name, description in COUNTERS.items()}
        self.last: dict[tuple[str, tuple], tuple[float, dict]] = {}
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.refresher = threading.Thread(target=self._refresh, name="rayrep-metrics", daemon=True)
        self.refresher.start()

    def write(self, record: dict) -> None:
        values = {name: record[key] for name, (key, _) in TRAIN_GAUGES.items()
                  if isinstance(record.get(key), (int, float))}
        step_seconds = record.get("time_step")
        trained = (record.get("fresh_tokens") or 0) + (record.get("replay_tokens") or 0)
        if step_seconds:
            values["trained_tokens_per_second"] = trained / step_seconds
        with self.lock:
            for name, value in values.items():
                self._set(name, value, self.tags)
            if step_seconds:
                phases = [p for p in PHASES if f"time_{p}" in record]
                for phase, seconds in phase_seconds(record, phases).items():
                    self._set("phase_share", seconds / step_seconds, {**self.tags, "phase": phase})
            for key, value in record.items():
                measure, slash, source = key.partition("/")
                if slash and measure in ("accuracy", "reward") and isinstance(value, (int, float)):
                    self._set(f"{measure}_by_source", value, {**self.tags, "data_source": source})
        if step_seconds:
            self._add("steps", 1, self.tags)
        self._add("generated_tokens", record.get("generated_tokens"), self.tags)
        self._add("trained_tokens", trained, self.tags)
        for key, n in record.items():
            if key.endswith("_replaced"):
                role = "generator" if "generator" in key else key.removesuffix("_replaced")
                self._add("actor_replacements", n, {**self.tags, "role": role})

    def _set(self, name: str, value: float, tags: dict) -> None:
        self.gauges[name].set(float(value), tags)
        self.last[name, tuple(sorted(tags.items()))] = (float(value), tags)

    def _add(self, name: str, value, tags: dict) -> None:
        if isinstance(value, (int, float)) and value > 0:  # (Ray's counters refuse 0)
            self.counters[name].inc(float(value), tags)

    def _refresh(self) -> None:
        while not self.stop.wait(REFRESH_S):
            with self.lock:
                for (name, _), (value, tags) in self.last.items():
                    self.gauges[name].set(value, tags)

    def close(self) -> None:
        self.stop.set()
        self.refresher.join()
