"""Plots: a run's learning curves and step times, two runs' eval curves, a study's arms.

    python -m rayrep.plots plot RUN_DIR    # PNGs of a run's metrics.jsonl in RUN_DIR/plots
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from rayrep.errors import InputError
from rayrep.stats.study import mean_curve, series
from rayrep.run.layout import RunFolder
from rayrep.run.phases import NESTED_PHASES, PHASES, phase_seconds


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


def plot_study_tokens(compute: dict, path: str | Path, title: str = "", reference: tuple[str, ...] = ()) -> Path:
    """A PNG of each arm's mean curve against the tokens its seeds generated and against the
    seconds their steps took (the seeds' means at each evaluation), with a band of +/- one
    standard error: `summarize_compute`'s curves, side by side, and its targets as dotted
    levels. The `reference` arms (the baseline at several batch sizes) are drawn grey, with
    their upper envelope: the frontier that more or fewer fresh questions give, which an arm
    above it beats at equal generation."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.8), dpi=120, sharey=True)
    targets = next(iter(compute.values()), {}).get("targets", {})
    # Matplotlib's colours but its grey (C7), which is the reference arms'; one colour an arm.
    colors = dict(zip([arm for arm in compute if arm not in reference], itertools.cycle(
        f"C{i}" for i in (0, 1, 2, 3, 4, 5, 6, 8, 9))))
    for axis, (index, scale, label) in zip(axes, ((1, 1e6, "generated tokens (millions)"),
                                                  (2, 60.0, "minutes of training steps"))):
        envelope: list[tuple[float, float]] = []
        for arm, row in compute.items():
            spent = [point[index] / scale for point in row["curve"]]
            means = [100 * m for *_, m, _ in row["curve"]]
            errors = [0.0 if math.isnan(se) else 100 * se for *_, se in row["curve"]]
            if arm in reference:
                axis.plot(spent, means, color="0.55", linestyle="--", linewidth=1, marker=".", markersize=4)
                axis.annotate(arm, (spent[-1], means[-1]), fontsize=7, color="0.4", xytext=(3, 0),
                              textcoords="offset points")
                envelope += list(zip(spent, means))
                continue
            axis.plot(spent, means, marker="o", markersize=3, color=colors[arm], label=f"{arm} ({row['seeds']} seeds)")
            axis.fill_between(spent, [m - e for m, e in zip(means, errors)], [m + e for m, e in zip(means, errors)],
                              color=colors[arm], alpha=0.2)
        if envelope:
            frontier, best = [], -math.inf
            for x, y in sorted(envelope):
                best = max(best, y)
                frontier.append((x, best))
            axis.plot(*zip(*frontier), color="0.3", linewidth=2.5, alpha=0.35,
                      label="the baselines' frontier (" + ", ".join(a for a in reference if a in compute) + ")")
        for number, (name, target) in enumerate(targets.items()):
            axis.axhline(100 * target["level"], color="0.6", linestyle=":", linewidth=0.8)
            axis.annotate(name, (0, 100 * target["level"]), fontsize=7, color="0.45",
                          xytext=(2, 2 if number % 2 else -9), textcoords="offset points",
                          xycoords=("axes fraction", "data"))  # (alternately above and below: close levels)
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("pass@1 on the test set (%)")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
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

def load_run_metrics(run_dir: str | Path) -> list[dict]:
    """The records of `<run_dir>/metrics.jsonl`, of the latest run that wrote there.

    A run folder reused by a later run (same `logging.run_name`) holds both runs' records,
    the later ones counting steps from 0 again: only those are returned. A last line not yet
    complete (the run is writing it now) is left out. Raises `MetricsFileError` for a missing
    folder, a missing or empty file, or a line that is not a record with an integer step.
    """
    run_dir = Path(run_dir)
    path = RunFolder(run_dir).metrics
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
        for name, seconds in phase_seconds(r, phases).items():
            parts[name].append(seconds)
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
        raise MetricsFileError(f"{RunFolder(run_dir).metrics}: none of the plotted metrics was logged")

    plt = pyplot()
    out = RunFolder(run_dir).plots
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


def write_plots(run_dir: Path, log=print) -> None:
    """The run's learning curves in `<run_dir>/plots`; a failure to draw them is a warning,
    not a failed run (the checkpoint and metrics are already written)."""
    try:
        paths = plot_run(run_dir)
    except Exception as err:  # whatever matplotlib raises, the run stands
        log(f"warning: no plots for {run_dir}: {type(err).__name__}: {err}")
        return
    log(f"plots: {', '.join(p.name for p in paths)} in {RunFolder(run_dir).plots}")


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


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rayrep.plots", description="Tools for a run's metrics.jsonl.")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="write a run's learning curves as PNGs to RUN_DIR/plots")
    plot.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run folder (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir):
        print(path)


if __name__ == "__main__":
    try:
        main()
    except InputError as err:  # a folder without a readable metrics.jsonl: one line, exit 2
        print(f"python -m rayrep.plots: {err}", file=sys.stderr)
        raise SystemExit(2) from None
