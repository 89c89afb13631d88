"""Metrics: weighted sums that merge across ranks, a JSONL log, optional wandb, learning-curve plots.

    python -m rayrep.metrics plot RUN_DIR    # PNGs of a run's metrics.jsonl in RUN_DIR/plots
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from rayrep.config import InputError


class MetricSums:
    """Accumulates metrics over micro-batches and ranks so that merging stays exact.

    `add(name, total, weight)`: the reported value is sum(total) / sum(weight) (a weighted
    mean: pass a fraction times its token count and the token count). `count(name, n)`:
    reported as a plain sum. `extreme(name, value)`: min or max by the name's suffix.
    """

    def __init__(self, state: dict | None = None):
        state = state or {}
        self.totals: dict[str, float] = dict(state.get("totals", {}))
        self.weights: dict[str, float] = dict(state.get("weights", {}))
        self.counts: dict[str, float] = dict(state.get("counts", {}))
        self.extremes: dict[str, float] = dict(state.get("extremes", {}))

    def add(self, name: str, total: float, weight: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + total
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def count(self, name: str, n: float = 1.0) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + n

    def extreme(self, name: str, value: float) -> None:
        pick = min if name.endswith("_min") else max
        self.extremes[name] = pick(self.extremes.get(name, value), value)

    def add_policy_metrics(self, metrics: dict[str, float]) -> None:
        """Fold in one micro-batch's `policy_loss` metrics, weighting by the tokens they cover."""
        fresh, replay = metrics.get("fresh_tokens", 0.0), metrics.get("replay_tokens", 0.0)
        self.count("fresh_tokens", fresh)
        self.count("replay_tokens", replay)
        for name, value in metrics.items():
            if name.endswith("_tokens"):
                continue
            if name.endswith(("_min", "_max")):
                self.extreme(name, value)
                continue
            weight = fresh if name.startswith("fresh_") else replay if name.startswith("replay_") else fresh + replay
            self.add(name, value * weight, weight)

    def merge(self, other: "MetricSums") -> "MetricSums":
        for name, total in other.totals.items():
            self.add(name, total, other.weights[name])
        for name, n in other.counts.items():
            self.count(name, n)
        for name, value in other.extremes.items():
            self.extreme(name, value)
        return self

    def state(self) -> dict:
        return {"totals": self.totals, "weights": self.weights, "counts": self.counts, "extremes": self.extremes}

    def result(self) -> dict[str, float]:
        out = {name: total / self.weights[name] for name, total in self.totals.items() if self.weights[name] > 0}
        out.update(self.counts)
        out.update(self.extremes)
        return out


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
        self.path = Path(run_dir) / "metrics.jsonl"
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


def compare_runs(baseline: list[dict], other: list[dict], metric: str = "test_pass@1") -> dict:
    """Peak and final of both eval curves, and the first step where `other` reaches the baseline's peak."""
    base, mine = series(baseline, metric), series(other, metric)
    base_peak_step, base_peak = max(base, key=lambda p: (p[1], -p[0]))
    mine_peak_step, mine_peak = max(mine, key=lambda p: (p[1], -p[0]))
    reached = next((step for step, value in mine if value >= base_peak), None)
    return {
        "metric": metric,
        "baseline": {"peak": base_peak, "peak_step": base_peak_step, "final": base[-1][1], "final_step": base[-1][0]},
        "other": {"peak": mine_peak, "peak_step": mine_peak_step, "final": mine[-1][1], "final_step": mine[-1][0]},
        "other_reaches_baseline_peak_at": reached,
    }


# ---------------------------------------------------------------- seeded studies


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean and its standard error (sample standard deviation / sqrt(n)); an SE of NaN
    for one value (one seed says nothing about the spread)."""
    if not values:
        raise ValueError("mean_and_se of no values")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def mean_curve(runs: Sequence[Sequence[dict]], metric: str = "test_pass@1") -> list[tuple[int, float, float]]:
    """`(step, mean, standard error)` over `runs` of `metric`, at the steps every run evaluated."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for step, value in series(run, metric):
            by_step.setdefault(step, []).append(value)
    return [(step, *mean_and_se(by_step[step])) for step in sorted(by_step) if len(by_step[step]) == len(runs)]


def first_step_reaching(points: Sequence[tuple[int, float]], level: float) -> int | None:
    """The first step whose value is at least `level`; None if none is."""
    return next((step for step, value in points if value >= level), None)


def summarize_study(curves: dict[str, list[list[dict]]], baseline: str = "baseline", metric: str = "test_pass@1",
                    seeds: dict[str, list[int]] | None = None) -> dict:
    """Per arm, over its seeds' eval curves (`curves[arm][i]`: the records of seed
    `seeds[arm][i]`; without `seeds`, of seed i):

    - `peak`, `final`: mean and standard error over seeds of each seed's peak and final value;
    - `reaches`: the first step at which each seed reaches the baseline's mean peak (None:
      never), and the mean and standard error over the seeds that do;
    - `eval_se`: the mean standard error of one evaluation (`<metric>_se`, where logged);
    - `curve`: the mean curve over seeds, `(step, mean, standard error)` (`mean_curve`);
    - other arms than the baseline, paired with the baseline by seed (same data order, same
      evaluation draws: the seed-to-seed spread they share cancels): `final_gain`, the mean
      and standard error of (final - the baseline's final), and `curve_gain`, of (the mean
      over evaluations after the first - the baseline's, at the steps both evaluated), over
      `paired_seeds` seeds.
    The baseline arm's mean peak is the level every arm is measured against."""
    if baseline not in curves or not curves[baseline]:
        raise ValueError(f"the study has no finished {baseline!r} run to compare with")
    points = {arm: [series(run, metric) for run in runs] for arm, runs in curves.items()}
    for arm, runs in points.items():
        if any(not run for run in runs):
            raise ValueError(f"arm {arm!r}: a run without any {metric} evaluation")
    seeds = {arm: (seeds or {}).get(arm, list(range(len(runs)))) for arm, runs in points.items()}
    by_seed = {arm: dict(zip(seeds[arm], runs)) for arm, runs in points.items()}
    level = mean_and_se([max(v for _, v in run) for run in points[baseline]])[0]
    summary = {"metric": metric, "baseline": baseline, "baseline_mean_peak": level, "arms": {}}
    for arm, runs in points.items():
        reaches = [first_step_reaching(run, level) for run in runs]
        reached = [step for step in reaches if step is not None]
        errors = [r[f"{metric}_se"] for run in curves[arm] for r in run if isinstance(r.get(f"{metric}_se"), (int, float))]
        summary["arms"][arm] = row = {
            "seeds": len(runs),
            "peak": mean_and_se([max(v for _, v in run) for run in runs]),
            "final": mean_and_se([run[-1][1] for run in runs]),
            "reaches": reaches,
            "reach_step": mean_and_se(reached) if reached else (None, None),
            "eval_se": sum(errors) / len(errors) if errors else None,
            "curve": mean_curve(curves[arm], metric),
        }
        paired = [(by_seed[arm][s], by_seed[baseline][s]) for s in seeds[arm] if s in by_seed[baseline]]
        if arm != baseline and paired:
            row["paired_seeds"] = len(paired)
            row["final_gain"] = mean_and_se([run[-1][1] - base[-1][1] for run, base in paired])
            row["curve_gain"] = mean_and_se([_curve_mean(run, base) - _curve_mean(base, run) for run, base in paired])
    return summary


def _curve_mean(run: list[tuple[int, float]], other: list[tuple[int, float]]) -> float:
    """The mean of `run`'s values after its first evaluation, at the steps `other` also has."""
    shared = {step for step, _ in other}
    values = [value for step, value in run[1:] if step in shared]
    return sum(values) / len(values) if values else math.nan


def study_table(summary: dict) -> str:
    """The study summary as a text table (percentages; mean +/- standard error over seeds)."""

    def pm(pair, scale=100.0, digits=1) -> str:
        mean, se = pair
        if mean is None:
            return "-"
        return f"{scale * mean:.{digits}f}" + ("" if math.isnan(se) else f" +/- {scale * se:.{digits}f}")

    def gain(row, name) -> str:
        if name not in row:
            return "-"
        mean, se = row[name]
        return f"{100 * mean:+.1f}" + ("" if math.isnan(se) else f" +/- {100 * se:.1f}")

    lines = [f"{'arm':<18}{'seeds':>6}{'peak %':>16}{'final %':>16}{'reaches baseline peak at step':>32}"
             f"{'one eval SE':>13}{'replayed %':>12}{'final - base':>16}{'curve - base':>16}"]
    for arm, row in summary["arms"].items():
        reached = sum(step is not None for step in row["reaches"])
        steps = f"{pm(row['reach_step'], 1.0, 0)} ({reached}/{row['seeds']})"
        error = "-" if row["eval_se"] is None else f"{100 * row['eval_se']:.2f}"
        replayed = f"{100 * row['replay_share']:.1f}" if "replay_share" in row else "-"
        lines.append(f"{arm:<18}{row['seeds']:>6}{pm(row['peak']):>16}{pm(row['final']):>16}{steps:>32}{error:>13}"
                     f"{replayed:>12}{gain(row, 'final_gain'):>16}{gain(row, 'curve_gain'):>16}")
    lines.append(f"baseline mean peak: {100 * summary['baseline_mean_peak']:.1f}% ({summary['metric']}); "
                 "replayed: the share of trained answers that were replayed, mean over steps and seeds; "
                 "final/curve - base: points above the same seed's baseline, mean +/- SE over seeds "
                 "(curve: the mean of the evaluations after step 0)")
    steps = sorted({step for row in summary["arms"].values() for step, _, _ in row["curve"]})
    lines += ["", f"mean {summary['metric']} (%) by step, +/- SE over seeds",
              f"{'arm':<18}" + "".join(f"{step:>14}" for step in steps)]
    for arm, row in summary["arms"].items():
        at = {step: (mean, se) for step, mean, se in row["curve"]}
        lines.append(f"{arm:<18}" + "".join(f"{pm(at[step]) if step in at else '-':>14}" for step in steps))
    return "\n".join(lines)


def plot_study(curves: dict[str, list[list[dict]]], path: str | Path, metric: str = "test_pass@1", title: str = "") -> Path:
    """A PNG of each arm's mean curve over seeds with a band of +/- one standard error (at
    the steps every seed of the arm evaluated)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=120)
    for arm, runs in curves.items():
        curve = mean_curve(runs, metric)
        steps = [step for step, _, _ in curve]
        means = [100 * mean for _, mean, _ in curve]
        errors = [0.0 if math.isnan(se) else 100 * se for _, _, se in curve]
        line = ax.plot(steps, means, marker="o", markersize=3, label=f"{arm} ({len(runs)} seeds)")[0]
        ax.fill_between(steps, [m - e for m, e in zip(means, errors)], [m + e for m, e in zip(means, errors)],
                        color=line.get_color(), alpha=0.2)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{metric.removeprefix('test_')} on the test set (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_curves(curves: dict[str, list[dict]], path: str | Path, metric: str = "test_pass@1", title: str = "") -> Path:
    """A PNG of `metric` against step, one line per run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for name, evals in curves.items():
        points = series(evals, metric)
        ax.plot([s for s, _ in points], [100 * v for _, v in points], marker="o", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{metric.removeprefix('test_')} on the test set (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first use
    so that importing this module stays cheap for every actor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)
    return path


def series(records: Sequence[dict], metric: str) -> list[tuple[int, float]]:
    """(step, value) of every record that logged `metric` as a number (NaN is logged as null)."""
    return [(r["step"], r[metric]) for r in records if isinstance(r.get(metric), (int, float))]


# ---------------------------------------------------------------- one run's learning curves


class MetricsFileError(InputError):
    """A run folder without a readable metrics.jsonl; the message names the path."""


CURVES = (  # (file name, title, y label, metric patterns (a line per metric that matches), in %, drawn if all 0)
    ("reward", "reward", "mean reward of fresh rollouts", (r"reward_mean",), False, True),
    ("test_accuracy", "test accuracy", "test questions (%)", (r"test_pass@1", r"test_maj@\d+"), True, True),
    ("entropy", "entropy", "mean token entropy", (r"fresh_entropy", r"replay_entropy"), False, True),
    ("response_length", "response length", "tokens per fresh rollout", (r"response_length",), False, True),
    ("replay_share", "replay share", "trained rollouts that are replayed (%)", (r"replay_share",), True, False),
)

PHASES = ("plan", "generate", "verify", "hand_over", "select", "build", "old_logprobs", "update", "sync")
"""The driver's timed phases of a step, in the order they run."""

NESTED_PHASES = {"old_logprobs": "update"}
"""Phases timed inside another one: the learners take the old log-probs within the update call."""


def load_run_metrics(run_dir: str | Path) -> list[dict]:
    """The records of `<run_dir>/metrics.jsonl`, of the latest run that wrote there.

    A run folder reused by a later run (same `logging.run_name`) holds both runs' records,
    the later ones counting steps from 0 again: only those are returned. A last line not yet
    complete (the run is writing it now) is left out. Raises `MetricsFileError` for a missing
    folder, a missing or empty file, or a line that is not a record with an integer step.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise MetricsFileError(f"{run_dir}: no such run folder")
    if not path.is_file():
        raise MetricsFileError(f"{path}: no such file (not a run folder, or the run has logged nothing yet)")
    text = path.read_text()
    lines = text.splitlines()
    records: list[dict] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise MetricsFileError(f"{path}, line {number}: not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise MetricsFileError(f"{path}, line {number}: not a metrics record (a JSON object with an integer step)")
        records.append(record)
    if not records:
        raise MetricsFileError(f"{path}: empty, no metrics logged yet")
    restarts = [i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"]]
    return records[restarts[-1] if restarts else 0 :]


def step_times(records: Sequence[dict]) -> tuple[list[int], dict[str, list[float]]]:
    """Each step's wall time split into its phases: the steps, and the seconds per phase.

    The phases are the driver's `time_*` phases in the order they run (`PHASES`, then any
    other `time_*` a newer version logs). Nested phases are split out of their parent
    (`update` is the update call without its old log-probs), so that the phases add up to
    `time_step`; what the step spent outside the timed phases (the algorithm's
    `after_update`, the buffer writes) is `other`. Evaluation runs after the step and is
    not part of `time_step`: it is the last part, `eval`, so that a bar is the wall time
    from one step to the next (step 0 is the evaluation before training).
    """
    rows = [r for r in records if any(isinstance(r.get(k), (int, float)) for k in ("time_step", "time_eval"))]
    logged = {k.removeprefix("time_") for r in rows for k, v in r.items() if k.startswith("time_") and v is not None}
    extra = sorted(logged - set(PHASES) - {"step", "eval"})
    phases = [p for p in (*PHASES, *extra) if p in logged]
    parts: dict[str, list[float]] = {name: [] for name in (*phases, "other", "eval")}
    for r in rows:
        seconds = {p: r.get(f"time_{p}") or 0.0 for p in phases}
        for child, parent in NESTED_PHASES.items():
            if child in seconds and parent in seconds:
                seconds[parent] = max(0.0, seconds[parent] - seconds[child])
        for p in phases:
            parts[p].append(seconds[p])
        step = r.get("time_step") or 0.0
        parts["other"].append(max(0.0, step - sum(seconds.values())) if step else 0.0)
        parts["eval"].append(r.get("time_eval") or 0.0)
    return [r["step"] for r in rows], {name: values for name, values in parts.items() if any(values)}


def plot_run(run_dir: str | Path) -> list[Path]:
    """Learning curves of a run as PNGs in `<run_dir>/plots/`; returns the paths written.

    One PNG per curve that the run logged (reward, test accuracy as pass@1 and maj@k,
    entropy, response length, replay share; a curve never logged is left out, and so is the
    replay share of a run that replayed nothing, such as GRPO's), `step_time.png` (each
    step's phases stacked, see `step_times`) and `overview.png` with all of them. Raises
    `MetricsFileError` for a run folder without metrics.
    """
    run_dir = Path(run_dir)
    records = load_run_metrics(run_dir)
    panels = []  # (file name, draw(ax, *spec), spec)
    for name, title, ylabel, patterns, percent, drawn_if_zero in CURVES:
        lines = {key: series(records, key) for key in matching_metrics(records, patterns)}
        lines = {key: points for key, points in lines.items() if any(v or drawn_if_zero for _, v in points)}
        if lines:
            panels.append((name, draw_curves, (title, ylabel, lines, percent)))
    steps, phases = step_times(records)
    if phases:
        panels.append(("step_time", draw_step_times, (steps, phases)))
    if not panels:
        raise MetricsFileError(f"{run_dir / 'metrics.jsonl'}: none of the plotted metrics was logged")

    plt = pyplot()
    out = run_dir / "plots"
    written = []
    for name, draw, spec in panels:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
        draw(ax, *spec)
        written.append(save_figure(fig, out / f"{name}.png"))
    columns = 2 if len(panels) <= 4 else 3
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.0 * columns, 3.4 * rows), dpi=100, squeeze=False)
    for ax, (_, draw, spec) in zip(axes.flat, panels):
        draw(ax, *spec)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(run_dir.name)
    written.append(save_figure(fig, out / "overview.png"))
    return written


def matching_metrics(records: Sequence[dict], patterns: Sequence[str]) -> list[str]:
    """The logged metric names that match each pattern in turn (within a pattern, in sorted order)."""
    names = {key for r in records for key in r}
    return [key for pattern in patterns for key in sorted(k for k in names if re.fullmatch(pattern, k))]


def draw_curves(ax, title: str, ylabel: str, lines: dict[str, list[tuple[int, float]]], percent: bool) -> None:
    scale = 100 if percent else 1
    for key, points in lines.items():
        sparse = len(points) <= 30  # evaluation curves: a point every few steps
        ax.plot([s for s, _ in points], [scale * v for _, v in points], marker="o" if sparse else None,
                markersize=3, label=key.removeprefix("test_"))
    ax.set_title(title)
    step_axis(ax)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=8)


def step_axis(ax) -> None:
    """Training steps on the x axis, whole numbers only."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("training step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def draw_step_times(ax, steps: list[int], phases: dict[str, list[float]]) -> None:
    bottom = [0.0] * len(steps)
    palette = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C9")  # a phase has its colour in every run's plot
    colors = dict(zip(PHASES, palette)) | {"other": "0.5", "eval": "0.85"}
    for name, seconds in phases.items():
        label = f"{name.replace('_', ' ')} (in {NESTED_PHASES[name]})" if name in NESTED_PHASES else name
        ax.bar(steps, seconds, bottom=bottom, width=0.8, linewidth=0, label=label, color=colors.get(name),
               hatch="//" if name == "eval" else None)
        bottom = [b + s for b, s in zip(bottom, seconds)]
    ax.set_title("step time")
    step_axis(ax)
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, axis="y")
    handles, labels = ax.get_legend_handles_labels()  # top to bottom, as the bars are stacked
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def comparison_table(names: tuple[str, str], comparison: dict) -> str:
    base, other = names
    b, o = comparison["baseline"], comparison["other"]
    reached = comparison["other_reaches_baseline_peak_at"]
    lines = [
        f"{'run':<12}{'peak ' + comparison['metric']:>22}{'at step':>9}{'final':>9}",
        f"{base:<12}{100 * b['peak']:>21.1f}%{b['peak_step']:>9}{100 * b['final']:>8.1f}%",
        f"{other:<12}{100 * o['peak']:>21.1f}%{o['peak_step']:>9}{100 * o['final']:>8.1f}%",
    ]
    if reached is None:
        lines.append(f"{other} did not reach the {base} peak ({100 * b['peak']:.1f}%) within {o['final_step']} steps")
    else:
        lines.append(f"{other} first reached the {base} peak ({100 * b['peak']:.1f}%, step {b['peak_step']}) "
                     f"at step {reached}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rayrep.metrics", description="Tools for a run's metrics.jsonl.")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="write a run's learning curves as PNGs to RUN_DIR/plots")
    plot.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run folder (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir):
        print(path)


if __name__ == "__main__":
    from rayrep.config import run_job

    run_job(main)
