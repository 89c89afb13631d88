"""Statistics over runs: a run's eval curve (`series`), two runs compared (`compare_runs`),
and a seeded study's arms summarized with standard errors, as tables. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rayrep.stats.formulas import mean_and_se


def series(records: Sequence[dict], metric: str) -> list[tuple[int, float]]:
    """(step, value) of every record that logged `metric` as a number (NaN is logged as null)."""
    return [(r["step"], r[metric]) for r in records if isinstance(r.get(metric), (int, float))]


def compare_runs(baseline: list[dict], other: list[dict], metric: str = "test_pass@1") -> dict:
    """Peak and final of both eval curves, and the first step where `other` reaches the baseline's peak."""
    base, mine = series(baseline, metric), series(other, metric)
    base_peak_step, base_peak = peak(base)
    mine_peak_step, mine_peak = peak(mine)
    reached = first_step_reaching(mine, base_peak)
    return {
        "metric": metric,
        "baseline": {"peak": base_peak, "peak_step": base_peak_step, "final": base[-1][1], "final_step": base[-1][0]},
        "other": {"peak": mine_peak, "peak_step": mine_peak_step, "final": mine[-1][1], "final_step": mine[-1][0]},
        "other_reaches_baseline_peak_at": reached,
    }


def mean_curve(runs: Sequence[Sequence[dict]], metric: str = "test_pass@1") -> list[tuple[int, float, float]]:
    """`(step, mean, standard error)` over `runs` of `metric`, at the steps every run evaluated."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for step, value in series(run, metric):
            by_step.setdefault(step, []).append(value)
    return [(step, *mean_and_se(by_step[step])) for step in sorted(by_step) if len(by_step[step]) == len(runs)]


def peak(points: Sequence[tuple[int, float]]) -> tuple[int, float]:
    """(step, value) of the highest value; the earliest step among equal ones."""
    return max(points, key=lambda p: (p[1], -p[0]))


def first_step_reaching(points: Sequence[tuple[int, float]], level: float) -> int | None:
    """The first step whose value is at least `level`; None if none is."""
    return next((step for step, value in points if value >= level), None)


def summarize_study(curves: dict[str, list[list[dict]]], baseline: str = "baseline", metric: str = "test_pass@1",
                    seeds: dict[str, list[int]] | None = None, contrasts: Sequence[tuple[str, str]] = ()) -> dict:
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
      `paired_seeds` seeds (`final_gains`: each seed's); `half_gains` and `own_peak_ratio`
      as `paired_differences` says;
    - `contrasts`: the same paired differences between two other arms, `(a, b)` for a - b,
      where both have runs of one seed at least (say, an ablation against its control).
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
        if arm != baseline:
            row.update(paired_differences(by_seed[arm], by_seed[baseline]))
    pairs = {f"{a} - {b}": paired_differences(by_seed[a], by_seed[b]) for a, b in contrasts if a in by_seed and b in by_seed}
    summary["contrasts"] = {name: c for name, c in pairs.items() if c}
    return summary


def paired_differences(runs: dict[int, list[tuple[int, float]]], others: dict[int, list[tuple[int, float]]]) -> dict:
    """One arm's eval curves against another's, by seed (`{seed: [(step, value)]}`), over the
    seeds both have: the mean and standard error of the differences in final value
    (`final_gain`; each seed's in `final_gains`) and in the mean over evaluations after the
    first (`curve_gain`, at the steps both evaluated), and the same over the evaluations up to
    the middle of the run's steps and after it (`half_gains`, split at `half_middle`); each
    seed's first step reaching the other's peak in that seed, with the step of that peak
    (`own_peak_steps`: `(step or None, peak step)`), and the mean and standard error of their
    ratio over the seeds that reach it (`own_peak_ratio`: the RLEP paper's 135 of 380 steps
    is 0.36); empty without a shared seed. A run of another length than the other's is
    paired at the same share of each run's steps (its steps rescaled to the other's): the
    arms that run twice the steps on half the generation a step meet the others at equal
    generation, not at half of it."""
    paired = [(_rescaled(runs[s], others[s]), others[s]) for s in runs if s in others]
    if not paired:
        return {}
    finals = [run[-1][1] - other[-1][1] for run, other in paired]
    # Whether a lead grows or closes: the curve gain over each half of the run's steps.
    middle = max(step for _, other in paired for step, _ in other) / 2
    halves = [[_curve_mean(run, other, part) - _curve_mean(other, run, part) for run, other in paired]
              for part in (lambda step: step <= middle, lambda step: step > middle)]
    # The papers' speed measure: the step at which a run first reaches its own seed's baseline
    # peak, against the step of that peak.
    own = [(first_step_reaching(run, peak(other)[1]), peak(other)[0]) for run, other in paired]
    ratios = [reached / at for reached, at in own if reached is not None and at > 0]
    return {"paired_seeds": len(paired), "final_gain": mean_and_se(finals), "final_gains": finals,
            "curve_gain": mean_and_se([_curve_mean(run, other) - _curve_mean(other, run) for run, other in paired]),
            "half_middle": middle, "half_gains": [mean_and_se(half) for half in halves],
            "own_peak_steps": own, "own_peak_ratio": mean_and_se(ratios) if ratios else (None, None)}


def _rescaled(run: list[tuple[int, float]], other: list[tuple[int, float]]) -> list[tuple[float, float]]:
    """`run`'s evaluations at the steps of `other`'s length: step x other's last / run's last
    (multiplied first, so that a step that lands on one of `other`'s lands on it exactly;
    the evaluations that land between `other`'s are left out of the paired means)."""
    length, other_length = run[-1][0], other[-1][0]
    if length == other_length or length <= 0 or other_length <= 0:
        return run
    return [(step * other_length / length, value) for step, value in run]


def _curve_mean(run: list[tuple[int, float]], other: list[tuple[int, float]], part=lambda step: True) -> float:
    """The mean of `run`'s values after its first evaluation, at the steps `other` also has
    (and `part` takes)."""
    shared = {step for step, _ in other}
    values = [value for step, value in run[1:] if step in shared and part(step)]
    return sum(values) / len(values) if values else math.nan


def spent(steps: Sequence[dict], evals: Sequence[dict], metric: str = "test_pass@1"
          ) -> list[tuple[int, float, float, float]]:
    """(step, tokens generated up to it, seconds its steps took up to it, `metric`) at each
    evaluation of a run, from its step records (`generated_tokens`, `time_step`)."""
    tokens, seconds, totals = 0.0, 0.0, {0: (0.0, 0.0)}
    for record in sorted(steps, key=lambda r: r["step"]):
        tokens += record.get("generated_tokens", 0.0)
        seconds += record.get("time_step", 0.0)
        totals[record["step"]] = (tokens, seconds)
    return [(step, *totals[step], value) for step, value in series(evals, metric) if step in totals]


def frontier_targets(runs: dict[str, list[list[tuple[int, float, float, float]]]], baseline: str = "baseline"
                     ) -> dict[str, float]:
    """The levels the compute frontier is read at, over `spent` curves: the baseline's mean
    final and mean peak over its seeds, and the highest level every seed of every arm
    reaches (the lowest of the runs' peaks)."""
    base = runs[baseline]
    return {"baseline final": sum(run[-1][3] for run in base) / len(base),
            "baseline peak": sum(max(point[3] for point in run) for run in base) / len(base),
            "every arm": min(max(point[3] for point in run) for curves in runs.values() for run in curves)}


def summarize_compute(runs: dict[str, list[list[tuple[int, float, float, float]]]], targets: dict[str, float],
                      seeds: dict[str, list[int]], baseline: str = "baseline") -> dict:
    """Per arm, over its seeds' `spent` curves (`runs[arm][i]`: seed `seeds[arm][i]`'s):

    - `curve`: at the steps every seed evaluated, (step, mean tokens, mean seconds, mean value,
      its standard error);
    - `tokens_per_step`: mean and standard error over seeds of the tokens a step generated;
    - `targets`, for each named level of `targets` (`frontier_targets`): `reached` (how many
      seeds first reached it at an evaluation), `tokens` and `seconds` (what they had spent
      by then, mean and standard error over those seeds), and for other arms than the
      baseline, paired by seed, `ratio`: the seed's tokens over its own baseline's to the same
      level, mean and standard error over the `ratio_seeds` seeds where both reached it
      (below 1: fewer generated tokens)."""
    summary = {}
    by_seed = {arm: dict(zip(seeds[arm], curves)) for arm, curves in runs.items()}

    def first(curve, level) -> tuple[float, float] | None:
        return next(((tokens, seconds) for _, tokens, seconds, value in curve if value >= level), None)

    for arm, curves in runs.items():
        shared = set.intersection(*({step for step, *_ in curve} for curve in curves))
        at = [{step: rest for step, *rest in curve} for curve in curves]
        curve = []
        for step in sorted(shared):
            values = [a[step] for a in at]
            curve.append((step, sum(v[0] for v in values) / len(values), sum(v[1] for v in values) / len(values),
                          *mean_and_se([v[2] for v in values])))
        steps = [max(step for step, *_ in c) for c in curves]
        row = summary[arm] = {"curve": curve, "seeds": len(curves), "targets": {},
                              "tokens_per_step": mean_and_se([c[-1][1] / max(1, n) for c, n in zip(curves, steps)])}
        for name, level in targets.items():
            reached = [f for f in (first(c, level) for c in curves) if f is not None]
            found = row["targets"][name] = {
                "level": level, "reached": len(reached),
                "tokens": mean_and_se([t for t, _ in reached]) if reached else (None, None),
                "seconds": mean_and_se([s for _, s in reached]) if reached else (None, None)}
            if arm != baseline and baseline in by_seed:
                ratios = []
                for seed, mine in by_seed[arm].items():
                    theirs = by_seed[baseline].get(seed)
                    pair = (first(mine, level), first(theirs, level)) if theirs is not None else (None, None)
                    if None not in pair and pair[1][0] > 0:
                        ratios.append(pair[0][0] / pair[1][0])
                found["ratio"] = mean_and_se(ratios) if ratios else (None, None)
                found["ratio_seeds"] = len(ratios)
    return summary


def compute_table(compute: dict) -> str:
    """`summarize_compute`'s summary as a text table: a block per target."""

    def pm(pair, scale=1.0, digits=0) -> str:
        mean, se = pair
        if mean is None:
            return "-"
        return f"{scale * mean:.{digits}f}" + ("" if math.isnan(se) else f" +/- {scale * se:.{digits}f}")

    first = next(iter(compute.values()))
    lines = ["what each arm spent until it first reached each target: generated tokens (thousands) and seconds of its "
             "steps, mean +/- SE over the seeds that did; and, paired by seed, its tokens over its own baseline's to "
             "the same level (below 1: fewer), mean +/- SE over the seeds where both did",
             f"{'arm':<24}{'k tokens / step':>18}"]
    lines += [f"{arm:<24}{pm(row['tokens_per_step'], 1e-3, 1):>18}" for arm, row in compute.items()]
    for name, target in first["targets"].items():
        lines += ["", f"target: {name}, {100 * target['level']:.1f}%",
                  f"{'arm':<24}{'reached':>9}{'k tokens':>16}{'seconds':>16}{'tokens / baseline':>24}"]
        for arm, row in compute.items():
            found = row["targets"][name]
            ratio = (pm(found["ratio"], 1.0, 2) + f" ({found['ratio_seeds']})" if found.get("ratio_seeds")
                     else "not reached" if not found["reached"] else "-") if "ratio" in found else "-"
            lines.append(f"{arm:<24}{found['reached']:>5}/{row['seeds']:<3}{pm(found['tokens'], 1e-3):>16}"
                         f"{pm(found['seconds']):>16}{ratio:>24}")
    return "\n".join(lines)


def study_table(summary: dict) -> str:
    """The study summary as a text table (percentages; mean +/- standard error over seeds)."""

    def pm(pair, scale=100.0, digits=1) -> str:
        mean, se = pair
        if mean is None:
            return "-"
        return f"{scale * mean:.{digits}f}" + ("" if math.isnan(se) else f" +/- {scale * se:.{digits}f}")

    def signed(pair) -> str:
        mean, se = pair
        return f"{100 * mean:+.1f}" + ("" if math.isnan(se) else f" +/- {100 * se:.1f}")

    def gain(row, name) -> str:
        return signed(row[name]) if name in row else "-"

    width = max([18] + [len(arm) + 2 for arm in summary["arms"]])  # the arm column: 18, or wider for a long name

    lines = [f"{'arm':<{width}}{'seeds':>6}{'peak %':>16}{'final %':>16}{'reaches baseline peak at step':>32}"
             f"{'one eval SE':>13}{'replayed %':>12}{'final - base':>16}{'curve - base':>16}"]
    for arm, row in summary["arms"].items():
        reached = sum(step is not None for step in row["reaches"])
        steps = f"{pm(row['reach_step'], 1.0, 0)} ({reached}/{row['seeds']})"
        error = "-" if row["eval_se"] is None else f"{100 * row['eval_se']:.2f}"
        replayed = f"{100 * row['replay_share']:.1f}" if "replay_share" in row else "-"
        lines.append(f"{arm:<{width}}{row['seeds']:>6}{pm(row['peak']):>16}{pm(row['final']):>16}{steps:>32}{error:>13}"
                     f"{replayed:>12}{gain(row, 'final_gain'):>16}{gain(row, 'curve_gain'):>16}")
    lines.append(f"baseline mean peak: {100 * summary['baseline_mean_peak']:.1f}% ({summary['metric']}); "
                 "replayed: the share of trained answers that were replayed, mean over steps and seeds; "
                 "final/curve - base: points above the same seed's baseline, mean +/- SE over seeds "
                 "(curve: the mean of the evaluations after step 0)")
    leads = {arm: row for arm, row in summary["arms"].items() if "half_gains" in row}
    if leads:
        lines += ["", "the lead over the same seed's baseline in each half of the run, points, mean +/- SE over seeds; "
                  "and the step each seed first reaches its own baseline's peak, / the step of that peak",
                  f"{'arm':<{width}}{'seeds':>6}{'halves split at':>17}{'first half':>16}{'second half':>16}"
                  f"   {'reaches own baseline peak':<28}{'ratio':>14}"]
        for arm, row in leads.items():
            reached = ", ".join(f"{'-' if step is None else format(step, 'g')}/{peak}" for step, peak in row["own_peak_steps"])
            lines.append(f"{arm:<{width}}{row['paired_seeds']:>6}{'step ' + format(row['half_middle'], 'g'):>17}"
                         f"{signed(row['half_gains'][0]):>16}{signed(row['half_gains'][1]):>16}   {reached:<28}"
                         f"{pm(row['own_peak_ratio'], 1.0, 2):>14}")
    if summary.get("contrasts"):
        lines += ["", "paired differences between arms, points, mean +/- SE over the seeds both ran (each seed's final)",
                  f"{'a - b':<40}{'seeds':>6}{'final':>16}{'curve':>16}   each seed's final"]
        for name, c in summary["contrasts"].items():
            each = ", ".join(f"{100 * d:+.1f}" for d in c["final_gains"])
            lines.append(f"{name:<40}{c['paired_seeds']:>6}{gain(c, 'final_gain'):>16}{gain(c, 'curve_gain'):>16}   {each}")
    steps = sorted({step for row in summary["arms"].values() for step, _, _ in row["curve"]})
    lines += ["", f"mean {summary['metric']} (%) by step, +/- SE over seeds",
              f"{'arm':<{width}}" + "".join(f"{step:>14}" for step in steps)]
    for arm, row in summary["arms"].items():
        at = {step: (mean, se) for step, mean, se in row["curve"]}
        lines.append(f"{arm:<{width}}" + "".join(f"{pm(at[step]) if step in at else '-':>14}" for step in steps))
    return "\n".join(lines)


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
